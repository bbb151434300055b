"""The release workflow cannot run here (it pushes to a registry); this checks it statically:
it parses, builds both variants from the Dockerfile's own build arguments, and tags them the
way the chart derives its images (repository:tag and repository:tag-cuda)."""
from __future__ import annotations

import re

import yaml

from kvyard.common import wire


def _workflow(ch) -> dict:
    doc = yaml.safe_load((ch.ROOT / ".github" / "workflows" / "release.yaml").read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


def test_release_builds_and_pushes_both_variants_under_the_charts_tags(ch):
    wf = _workflow(ch)
    assert wf["on"]["push"]["tags"] == ["v*.*.*"]
    assert set(wf["jobs"]) == {"check", "images"}
    images = wf["jobs"]["images"]
    assert images["needs"] == "check" and images["permissions"]["packages"] == "write"
    variants = {m["variant"]: m for m in images["strategy"]["matrix"]["include"]}
    assert set(variants) == {"cpu", "cuda"}
    # the chart's kvyard.cudaImage: the same tag with -cuda
    assert (variants["cpu"]["suffix"], variants["cuda"]["suffix"]) == ("", "-cuda")
    assert "cu1" in variants["cuda"]["torch_index"] and variants["cuda"]["demo_model"] == "0"
    assert variants["cpu"]["demo_model"] == "1"
    assert wf["env"]["IMAGE"] == wire.IMAGE_REPOSITORY == ch.chart().values["image"]["repository"]
    [build] = [s for s in images["steps"] if s.get("id") == "build"]
    assert build["uses"].startswith("docker/build-push-action@")
    assert build["with"]["tags"] == \
        "${{ env.IMAGE }}:${{ needs.check.outputs.version }}${{ matrix.suffix }}"
    assert build["with"]["push"] == "${{ github.ref_type == 'tag' }}"
    # every build argument it passes is one the Dockerfile declares
    dockerfile = (ch.ROOT / "Dockerfile").read_text()
    declared = set(re.findall(r"^ARG (\w+)", dockerfile, re.M))
    passed = {line.split("=", 1)[0].strip() for line in build["with"]["build-args"].splitlines()
              if line.strip()}
    assert passed and passed <= declared
    # the version check reads the chart's appVersion, so tag and chart cannot disagree
    [check] = wf["jobs"]["check"]["steps"][1:]
    assert "charts/kvyard/Chart.yaml" in check["run"] and "appVersion" in check["run"]
    assert "${{" not in check["run"]  # inputs reach the script as environment, not text
