"""Where a local stack keeps its state and logs: `--run-dir`, else
`$KVYARD_RUN_DIR`, else `.kvyard/run` under the current directory, so one
checkout has one stack and `up`, `status`, `down` find it without flags."""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_run_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=None,
                   help="state and logs (default $KVYARD_RUN_DIR or .kvyard/run)")


def run_dir(args: argparse.Namespace) -> Path:
    return Path(args.run_dir or os.environ.get("KVYARD_RUN_DIR") or ".kvyard/run").resolve()
