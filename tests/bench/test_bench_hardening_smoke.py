"""`kvyard bench hardening` end to end, one pair per row and no soak: the report's
shape, and the counts that are not timings (no 5xx, every error OpenAI-shaped,
the 20,000 stop strings refused and the cap served)."""
from __future__ import annotations

import json
import subprocess
import sys


def test_bench_hardening_reports_every_row() -> None:
    argv = [sys.executable, "-m", "kvyard.cli", "bench", "hardening", "--pairs", "1",
            "--soak-seconds", "0", "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["check"]: r for r in json.loads(out.stdout)["rows"]}
    for where in ("gateway", "worker"):
        assert rows[f"bad input via {where}: 5xx or no answer"]["value"] == 0
        assert rows[f"bad input via {where}: not OpenAI-shaped"]["value"] == 0
        assert rows[f"bad input via {where}: 5xx or no answer"]["baseline"] > 30
    assert rows["normal request beside 20,000 stop strings"]["statuses"] == [400]
    assert rows["normal request beside the cap, 128 x 512"]["statuses"] == [200]
    assert rows["CPU to refuse a 10 MB body"]["statuses"] == [413]
    assert all(r["value"] > 0 for c, r in rows.items() if c.startswith("normal request"))
