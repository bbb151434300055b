"""The engine behind the server: an asyncio face on a step loop in its own thread.

Torch releases the GIL inside its kernels, so a dedicated thread keeps the
event loop responsive while a step runs. All engine state lives on that
thread: requests and aborts reach it through a thread-safe queue and are
applied between steps; outputs come back to the event loop in one batch per
step via `call_soon_threadsafe`. When idle the thread sleeps on an Event.

A request whose consumer goes away (stops iterating, is cancelled: a client
disconnect) is aborted and its blocks freed on the next loop turn.

P/D: a decode request's remote KV is fetched on the event loop (`remote_kv`,
an awaitable) while the request is parked in the engine, so the step loop
never waits on the network; the blocks reach the engine thread as a command.
Prefill holds grow as the prompt's chunks compute and are reaped between
steps; the peer server reads held blocks off the engine thread (`gather_blocks`:
nobody writes them while held).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence as Seq

import numpy as np
import torch

from .api import EngineStats, RemoteKV, RequestOutput, SamplingParams
from .kv_blocks import gather, layout_of
from .kv_holds import KVHold
from .block_manager import KVEvent
from .config import EngineConfig
from .llm_engine import LLMEngine

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while serving this request (the request did not complete)."""


class EngineSleeping(EngineError):
    """The engine is asleep (sleep mode) or going to sleep: it takes no request."""


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.engine = engine if engine is not None else LLMEngine.from_config(config)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.served_model_name = self.engine.served_model_name
        self.max_model_len = self.engine.max_model_len
        self._cmds: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.engine.set_kv_load_waker(self._wake.set)  # a finished connector load wakes the loop
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._lifecycle: collections.deque = collections.deque()  # sleep/wake ops, in order
        # P/D: told (on the engine thread) how long each remote KV load took
        self.on_remote_kv_loaded: Callable[[float], None] | None = None

    # ---- lifecycle -----------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvyard-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(thread.join)
        self._thread = None
        self.engine.abort_all()
        self.engine.kv_holds.close()    # pulls waiting for a hold end now
        err = EngineError("the engine shut down before this request finished")
        for q in self._queues.values():
            q.put_nowait(err)

    # ---- requests ------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: Seq[int],
                       params: SamplingParams, *, hold_kv: bool = False,
                       hold_id: str | None = None,
                       remote_kv: Awaitable[RemoteKV | None] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has `finished` set.

        `hold_kv`, `hold_id`: a P/D prefill (see LLMEngine.add_request). `remote_kv`: a P/D
        decode: the request is parked until this resolves (to None, or on any
        error: it prefills itself). Raises ValueError for a request that can
        never run (checked before it queues) and EngineError if the engine
        fails while serving it.
        """
        if self._thread is None:
            await self.start()
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("generate() must run on the event loop that started the engine")
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._submit(("add", request_id, list(prompt_token_ids), params, hold_kv, hold_id,
                      remote_kv is not None))
        fetch = None if remote_kv is None else asyncio.ensure_future(
            self._remote(request_id, remote_kv))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if fetch is not None and not fetch.done():
                fetch.cancel()
            if self._queues.get(request_id) is q:
                del self._queues[request_id]
            if not finished:
                self._submit(("abort", request_id))

    async def _remote(self, request_id: str, remote_kv: Awaitable[RemoteKV | None]) -> None:
        try:
            blocks = await remote_kv
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - whatever failed, the request prefills itself
            log.exception("remote KV for %s failed; prefilling locally", request_id)
            blocks = None
        self._submit(("remote_kv", request_id, blocks))

    # ---- P/D prefill holds (the peer server's side) --------------------------
    def claim_hold(self, request_id: str, wait_s: float = 0.0) -> KVHold | None:
        """The hold, once (blocking up to `wait_s` for one not opened yet: call from a
        thread when waiting)."""
        return self.engine.kv_holds.claim(request_id, wait_s=wait_s)

    def wait_hold(self, hold: KVHold, have: int, timeout_s: float) -> tuple[int, bool]:
        """From a thread: see KVHolds.wait (a growing hold's next blocks)."""
        return self.engine.kv_holds.wait(hold, have, timeout_s)

    def finish_hold(self, request_id: str) -> None:
        """The hold's blocks may go back; the engine thread releases them next turn."""
        self.engine.kv_holds.finish(request_id)
        self._wake.set()

    def gather_blocks(self, block_ids: Seq[int], out: np.ndarray) -> None:
        """Copy held blocks into `out` (any thread; see kv_blocks.gather)."""
        gather(self.engine.runner.kv_caches, block_ids, out)

    def block_pieces(self) -> list[np.ndarray] | None:
        """Per layer, the KV cache as uint8 `[2, blocks, bytes]` views (CPU caches; None
        on a device): a block's payload is, for each layer, its K row then its V row, so
        the peer server can send held blocks from where they lie (see gather_blocks)."""
        caches = self.engine.runner.kv_caches
        if caches[0].device.type != "cpu":
            return None
        return [c.view(-1).view(torch.uint8).numpy().reshape(2, c.shape[1], -1) for c in caches]

    @property
    def kv_layout(self) -> Any:
        return layout_of(self.engine.runner.kv_caches)
    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort"."""
        self._submit(("abort", request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- sleep mode (sleep_mode.py; the routes: kvyard.workers.server.sleep) ---
    @property
    def sleep_level(self) -> int:
        return self.engine.sleep_level

    async def sleep(self, level: int = 1) -> None:
        """Sleeps once the engine holds no request (requests in it finish first; the
        server stops sending new ones before it calls this)."""
        await self._lifecycle_op("sleep", level)

    async def wake_up(self) -> None:
        await self._lifecycle_op("wake", 0)

    async def _lifecycle_op(self, op: str, level: int) -> None:
        if self._thread is None:
            await self.start()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("lifecycle", op, level, fut))
        await asyncio.wrap_future(fut)

    def _run_lifecycle(self) -> None:
        """Engine thread: sleep/wake ops in arrival order; a sleep waits for the drain."""
        eng = self.engine
        while self._lifecycle:
            op, level, fut = self._lifecycle[0]
            if op == "sleep" and eng.has_unfinished_requests():
                return
            self._lifecycle.popleft()
            try:
                eng.sleep(level) if op == "sleep" else eng.wake_up()
            except BaseException as e:  # noqa: BLE001 - the caller hears it
                log.exception("%s failed", op)
                fut.set_exception(e)
            else:
                fut.set_result(None)

    def add_kv_event_listener(self, callback: Callable[[KVEvent], None]) -> None:
        """See LLMEngine.add_kv_event_listener: runs on the engine thread, not the event loop."""
        self.engine.add_kv_event_listener(callback)

    # ---- the engine thread ---------------------------------------------------
    def _submit(self, cmd: tuple[Any, ...]) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    def _run(self) -> None:
        eng = self.engine
        while True:
            self._wake.clear()          # before draining: a later submit wakes the wait below
            out: list[RequestOutput | tuple[str, BaseException]] = []
            self._apply_commands(out)
            eng.reap_kv_holds()
            if self._lifecycle:
                self._run_lifecycle()
            if self._stopping:
                self._deliver(out)
                return
            if eng.has_schedulable_requests():
                try:
                    out.extend(eng.step())
                except Exception as e:  # noqa: BLE001 - every request must hear about it
                    log.exception("engine step failed")
                    err = EngineError(f"engine step failed: {type(e).__name__}: {e}")
                    failed = list(eng.scheduler.requests)
                    try:
                        eng.abort_all()
                    except Exception:  # noqa: BLE001
                        log.exception("could not free the failed requests' blocks")
                    out.extend((rid, err) for rid in failed)
            self._deliver(out)
            if self._lifecycle:         # the step may have finished the last request
                self._run_lifecycle()
            if not eng.has_schedulable_requests() and self._cmds.empty():
                if eng.idle_work():     # a few ms of it, then look for work again
                    continue
                deadline = eng.kv_holds.next_deadline()
                self._wake.wait(None if deadline is None
                                else max(0.0, deadline - time.monotonic()) + 0.01)

    def _apply_commands(self, out: list) -> None:
        eng = self.engine
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "lifecycle":
                self._lifecycle.append(cmd[1:])
            elif cmd[0] == "add":
                _, rid, ids, params, hold_kv, hold_id, parked = cmd
                if eng.sleep_level or self._lifecycle:
                    out.append((rid, EngineSleeping("the model is sleeping (sleep mode); "
                                                    "wake it with POST /wake_up")))
                    continue
                try:
                    eng.add_request(rid, ids, params, hold_kv=hold_kv, hold_id=hold_id,
                                    parked=parked)
                except Exception as e:  # noqa: BLE001 - reported to that request only
                    out.append((rid, e))
            elif cmd[0] == "remote_kv":
                try:
                    t0 = time.perf_counter()
                    eng.load_remote_kv(cmd[1], cmd[2])
                    if cmd[2] is not None and self.on_remote_kv_loaded is not None:
                        self.on_remote_kv_loaded(time.perf_counter() - t0)
                except Exception:  # noqa: BLE001 - the request still runs, prefilling itself
                    log.exception("loading remote KV for %s failed", cmd[1])
                    seq = eng.scheduler.parked.get(cmd[1])
                    if seq is not None:
                        eng.block_manager.release(seq.pinned_blocks)
                        seq.pinned_blocks = []
                        eng.scheduler.unpark(cmd[1])
            else:
                done = eng.abort_request(cmd[1])
                if done is not None:
                    out.append(done)

    def _deliver(self, items: list) -> None:
        if not items or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, items)
        except RuntimeError:    # the event loop is closed: nobody is listening any more
            pass

    def _dispatch(self, items: list) -> None:
        """Runs on the event loop: route each output or error to its request's queue."""
        for item in items:
            if isinstance(item, tuple):
                rid, payload = item
            else:
                rid, payload = item.request_id, item
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(payload)
