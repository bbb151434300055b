"""What the gateway tests share: waiting for a started Envoy and EPP to be ready."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest


async def wait_ready(s: aiohttp.ClientSession, admin: int, epp) -> None:
    """Envoy's admin /ready answers 200 and the EPP is ready (polls, with a deadline)."""
    deadline = time.monotonic() + 30  # Envoy starts slowly on a busy machine
    while True:
        try:
            async with s.get(f"http://127.0.0.1:{admin}/ready") as r:
                if r.status == 200 and epp.is_ready():
                    return
        except aiohttp.ClientError:
            pass
        assert time.monotonic() < deadline, "gateway or EPP never became ready"
        await asyncio.sleep(0.05)  # the readiness probe's poll period


@pytest.fixture
def gateway_ready():
    return wait_ready
