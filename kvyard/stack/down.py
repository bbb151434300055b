"""`kvyard down`: stop everything `kvyard up` started, from the state file alone,
so it works after `up`, a worker, or the whole shell crashed. The supervisor is
stopped first, so it does not restart what down is stopping."""
from __future__ import annotations

import argparse

from kvyard.stack.rundir import add_run_dir, run_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=5.0, help="seconds before SIGKILL")
    add_run_dir(p)


def run(args: argparse.Namespace) -> int:
    from kvyard.stack.launch import stop_stack
    from kvyard.stack.state import StackState

    rd = run_dir(args)
    state = StackState.load(rd)
    if state is None:
        print(f"kvyard: no stack in {rd}")
        return 0
    stop_stack(state, args.timeout)
    n = len(state.procs) + (state.supervisor is not None)
    print(f"kvyard: stopped {n} process(es) from {rd} (the supervisor first)")
    return 0
