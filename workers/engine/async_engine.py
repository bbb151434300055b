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
steps; the peer server claims, waits for and reads held blocks off the engine
thread through `handoff` (handoff.py: nobody writes them while held).

Commands reach the engine thread as the dataclasses below (`_Add`, `_Abort`,
`_RemoteKV`, `_Lifecycle`), applied in arrival order between steps.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence as Seq

from .api import EngineStats, RemoteKV, RequestOutput, SamplingParams
from .block_manager import KVEvent
from .config import EngineConfig
from .handoff import Handoff
from .llm_engine import LLMEngine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hold_kv: bool
    hold_id: str | None
    parked: bool


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _RemoteKV:
    request_id: str
    remote: RemoteKV | None


@dataclass(slots=True)
class _Lifecycle:
    op: str                              # "sleep" | "wake"
    level: int
    done: concurrent.futures.Future


_Command = _Add | _Abort | _RemoteKV | _Lifecycle


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
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.engine.set_kv_load_waker(self._wake.set)  # a finished connector load wakes the loop
        self.handoff: Handoff = self.engine.handoff     # the peer server's side of P/D
        self.handoff.waker = self._wake.set             # a finished hold's blocks go back soon
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._lifecycle: collections.deque[_Lifecycle] = collections.deque()  # in order
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
        self.handoff.close()            # pulls waiting for a hold end now
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
        self._submit(_Add(request_id, list(prompt_token_ids), params, hold_kv, hold_id,
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
                self._submit(_Abort(request_id))

    async def _remote(self, request_id: str, remote_kv: Awaitable[RemoteKV | None]) -> None:
        try:
            blocks = await remote_kv
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - whatever failed, the request prefills itself
            log.exception("remote KV for %s failed; prefilling locally", request_id)
            blocks = None
        self._submit(_RemoteKV(request_id, blocks))

    @property
    def kv_layout(self) -> Any:
        return self.handoff.layout

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort"."""
        self._submit(_Abort(request_id))

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
        self._submit(_Lifecycle(op, level, fut))
        await asyncio.wrap_future(fut)

    def _run_lifecycle(self) -> None:
        """Engine thread: sleep/wake ops in arrival order; a sleep waits for the drain."""
        eng = self.engine
        while self._lifecycle:
            cmd = self._lifecycle[0]
            if cmd.op == "sleep" and eng.has_unfinished_requests():
                return
            self._lifecycle.popleft()
            try:
                eng.sleep(cmd.level) if cmd.op == "sleep" else eng.wake_up()
            except BaseException as e:  # noqa: BLE001 - the caller hears it
                log.exception("%s failed", cmd.op)
                cmd.done.set_exception(e)
            else:
                cmd.done.set_result(None)

    def add_kv_event_listener(self, callback: Callable[[KVEvent], None]) -> None:
        """See LLMEngine.add_kv_event_listener: runs on the engine thread, not the event loop."""
        self.engine.add_kv_event_listener(callback)

    # ---- the engine thread ---------------------------------------------------
    def _submit(self, cmd: _Command) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    def _run(self) -> None:
        eng = self.engine
        while True:
            self._wake.clear()          # before draining: a later submit wakes the wait below
            out: list[RequestOutput | tuple[str, BaseException]] = []
            self._apply_commands(out)
            self.handoff.reap()
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
                    failed = eng.request_ids()
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
                deadline = self.handoff.next_deadline()
                self._wake.wait(None if deadline is None
                                else max(0.0, deadline - time.monotonic()) + 0.01)

    def _apply_commands(self, out: list) -> None:
        eng = self.engine
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Lifecycle):
                self._lifecycle.append(cmd)
            elif isinstance(cmd, _Add):
                if eng.sleep_level or self._lifecycle:
                    out.append((cmd.request_id, EngineSleeping(
                        "the model is sleeping (sleep mode); wake it with POST /wake_up")))
                    continue
                try:
                    eng.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                    hold_kv=cmd.hold_kv, hold_id=cmd.hold_id, parked=cmd.parked)
                except Exception as e:  # noqa: BLE001 - reported to that request only
                    out.append((cmd.request_id, e))
            elif isinstance(cmd, _RemoteKV):
                try:
                    t0 = time.perf_counter()
                    eng.load_remote_kv(cmd.request_id, cmd.remote)
                    if cmd.remote is not None and self.on_remote_kv_loaded is not None:
                        self.on_remote_kv_loaded(time.perf_counter() - t0)
                except Exception:  # noqa: BLE001 - the request still runs, prefilling itself
                    log.exception("loading remote KV for %s failed", cmd.request_id)
            else:
                done = eng.abort_request(cmd.request_id)
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
