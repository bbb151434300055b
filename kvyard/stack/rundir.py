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


def kvyard_command() -> str:
    """How the user can type `kvyard` right now: bare if on PATH, else the venv's path
    (`make demo` runs it from .venv/bin without activating the venv)."""
    import shutil
    import sys

    exe = Path(sys.executable).parent / "kvyard"
    if shutil.which("kvyard") == str(exe) or not exe.exists():
        return "kvyard"
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)
