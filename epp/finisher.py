"""The post-response step: teach the plugins the whole prompt once it is hashed."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from .pool.endpoints import EndpointPool
from .prompt import LazyPrompt
from .scheduling.scheduler import Scheduler
from .scheduling.types import Decision


@dataclass(slots=True)
class Finisher:
    """Hashes the rest of a routed prompt in a worker thread (the Rust
    tokenizer releases the GIL) and teaches the `PostResponse` plugins (the
    prefix index) on the loop, after Envoy has its answer.

    The backlog is bounded: under overload we skip teaching (the index then
    knows only the prefix hashed during the decision) rather than queue work
    without limit. `settle()` lets the next decision wait (briefly) for
    teaching still in flight: otherwise a follow-up request that shares the
    prefix could be routed before the index knows where the prefix went,
    which broke stickiness on a loaded machine. The wait is normally a few
    ms (the rest of one prompt's hashing) and is capped.
    """

    pool: EndpointPool
    scheduler: Scheduler
    max_backlog: int = 256
    settle_timeout_s: float = 0.5
    backlog: int = 0
    skipped: int = 0
    # Active-active replicas (replicas/): what was taught is told to the peers too.
    on_learn: Callable[[str, list[int]], None] | None = None
    _pending: set = field(default_factory=set)
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="epp-finish"))

    def submit(self, d: Decision) -> None:
        p = d.prompt
        if p is None or p.done:
            return
        if self.backlog >= self.max_backlog:
            self.skipped += 1
            return
        self.backlog += 1
        # P/D: the prefill pod computed the prompt's KV and the decode pod holds it after
        # the handoff, so both learn it.
        where = [d.endpoint.address] + ([d.prefill.address] if d.prefill is not None else [])
        task = asyncio.ensure_future(self._finish(where, p))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _finish(self, addresses: list[str], prompt: LazyPrompt) -> None:
        try:
            hashes = await asyncio.get_running_loop().run_in_executor(self._executor, prompt.finish)
        except Exception:  # noqa: BLE001 - teaching is best effort; routing already happened
            return
        finally:
            self.backlog -= 1
        for address in addresses:
            if self.pool.get(address) is not None:  # it may have left meanwhile
                self.scheduler.learn(address, hashes)
                if self.on_learn is not None:
                    self.on_learn(address, hashes)

    async def settle(self) -> None:
        """Wait, at most `settle_timeout_s`, until earlier decisions are taught."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=self.settle_timeout_s)

    def close(self) -> None:
        for t in self._pending:
            t.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
