"""manifests/kind/e2e.sh needs docker and kind, so it cannot run in the tests; it is parsed by
bash, linted by shellcheck (.ci/run installs it) and checked to walk a user's whole day."""
from __future__ import annotations

import shutil
import subprocess


def _script(ch):
    return ch.ROOT / "manifests" / "kind" / "e2e.sh"


def test_e2e_script_parses_and_is_shellcheck_clean(ch):
    r = subprocess.run(["bash", "-n", str(_script(ch))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed (Debian: shellcheck; .ci/run installs it)"
    r = subprocess.run([shellcheck, "--severity=info", str(_script(ch))], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_e2e_script_walks_a_users_day(ch):
    text = _script(ch).read_text()
    steps = ["helm upgrade --install kvyard",            # install
             "log \"chat requests through the gateway\"",  # chat through the gateway
             '"/metrics", "/version"',                    # the gateway exposes the API only
             "helm upgrade kvyard", "--set inferenceService.spec",  # a changed value
             "scaleToZero: {enabled: true", "never scaled to zero", 'chat 600 "wake up"',
             "prefill: {replicas: 1}", "the prefill pool was never picked",
             "helm uninstall kvyard", "left behind after helm uninstall"]
    positions = [text.find(s) for s in steps]
    assert all(p >= 0 for p in positions), [s for s, p in zip(steps, positions) if p < 0]
    assert positions == sorted(positions), "the steps are out of order"
