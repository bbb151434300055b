"""Simulated pods in the test's own event loop, on free loopback ports."""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import pytest

from kvyard.common.tokenizer import load_tokenizer
from kvyard.sim.config import PodPlan
from kvyard.sim.pool import PodGroup, PodSettings
from kvyard.sim.profiles import load_profile


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer("demo")


@pytest.fixture
def start_pods(free_port, tok):
    """`async with start_pods(n, ...) as group`: n pods (fast: h200 at 100x time scale)."""
    @asynccontextmanager
    async def start(n: int = 1, roles: list[str] | None = None, kv_events=None,
                    **settings) -> AsyncIterator[PodGroup]:
        settings.setdefault("profile", load_profile("h200"))
        settings.setdefault("time_scale", 100.0)
        settings.setdefault("seed", 1)
        plans = []
        for i in range(n):
            port = free_port()
            ev = kv_events(i) if kv_events else None
            plans.append(PodPlan(port, (roles or ["both"] * n)[i], f"127.0.0.1:{port}", ev))
        group = await PodGroup().start(plans, PodSettings(**settings), tok)
        try:
            yield group
        finally:
            await group.stop()
    return start
