"""The predictor's optional trace: one JSON line per followed request (the state it was
routed in, the prediction made for it and its outcome), for fitting models offline
(`kvyard.bench.slo_fit`)."""
from __future__ import annotations

import json
from typing import Callable


def jsonl_writer(path: str) -> Callable[[dict], None]:
    f = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: readable mid-run

    def write(rec: dict) -> None:
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")

    return write
