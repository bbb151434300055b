"""Fixtures every component's tests share: free ports, deadlines, the demo model.

Tests start and stop their own servers on free loopback ports and poll with
deadlines; nothing sleeps to synchronise.
"""
from __future__ import annotations

import os

# Before torch loads anywhere in the session: spinning OpenMP threads starve
# the servers' own threads on small machines (see kvyard/cli.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import time
from pathlib import Path
from typing import Callable

import pytest

from kvyard.stack.procs import free_port as _any_free_port


# Ports handed out in this session: a port is released as soon as it is known, so the
# kernel may offer the same one to the next call, and one test's two servers would share
# it (seen in CI).
_GIVEN: set[int] = set()


def _free_port() -> int:
    return _any_free_port(taken=_GIVEN)


@pytest.fixture
def free_port() -> Callable[[], int]:
    return _free_port


def _wait_until(pred: Callable[[], object], timeout: float = 30.0, interval: float = 0.02,
                what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - keep polling until the deadline
            last_exc = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}: {last_exc!r}")


@pytest.fixture
def wait_until() -> Callable[..., object]:
    return _wait_until


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    from kvyard.common.models import demo_gguf_path

    return demo_gguf_path()
