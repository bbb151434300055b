"""KV-connector loads off the engine thread.

A kvstore hit read from SSD or Redis takes tens to hundreds of milliseconds;
on the engine thread that would stall every running stream for as long. The
scheduler hands each load to a `KVLoader` as a `KVLoad` and parks the request
(scheduler.py says how); the loader runs `connector.load` on its own thread
and posts the finished job back, and the engine thread collects it at the
start of its next schedule. Only the engine thread touches block tables: the
loader thread only fills the cache rows of blocks the job owns, which nothing
else reads or writes until the job is collected.

On a CUDA device the loads run on a stream of their own, synchronised before a
job is posted (on failure too): once the engine thread sees a job, its copies
are complete and no copy of it is still queued behind the model's work.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class KVLoad:
    """One request's connector load: `block_ids` (its own, allocated and referenced
    before the job starts) filled with the blocks under `block_hashes`."""

    seq: Any                             # the Sequence that owns the blocks
    block_hashes: list[int]
    block_ids: list[int]
    local_blocks: int                    # its local prefix-cache hits before these
    waiters: list[Any] = field(default_factory=list)  # requests that need the same blocks
    detached: bool = False               # its request ended meanwhile: free on collection
    loaded: int = 0                      # leading blocks the connector filled
    error: BaseException | None = None
    seconds: float = 0.0


class KVLoader:
    """One worker thread running connector loads in submission order."""

    def __init__(self, connector: Any, device: torch.device | None = None) -> None:
        self.connector = connector
        self.device = device
        self.notify: Callable[[], None] | None = None  # called (loader thread) per finished job
        self._q: queue.SimpleQueue[KVLoad | None] = queue.SimpleQueue()
        self._done: list[KVLoad] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.in_flight = 0                   # submitted, not yet collected (engine thread)
        self.loads_total = 0
        self.failures_total = 0

    def submit(self, job: KVLoad) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvyard-kv-load", daemon=True)
            self._thread.start()
        self.in_flight += 1
        self._q.put(job)

    def has_completed(self) -> bool:
        with self._cv:
            return bool(self._done)

    def completed(self) -> list[KVLoad]:
        """Finished jobs, oldest first; never blocks (engine thread)."""
        with self._cv:
            done, self._done = self._done, []
        self.in_flight -= len(done)
        return done

    def wait(self, timeout: float) -> bool:
        """Block until a job has finished or `timeout` passed (synchronous drivers)."""
        with self._cv:
            return self._cv.wait_for(lambda: bool(self._done), timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Block until every submitted job has finished (tests, benchmarks)."""
        with self._cv:
            return self._cv.wait_for(lambda: len(self._done) >= self.in_flight, timeout)

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)

    def _run(self) -> None:
        stream = torch.cuda.Stream(self.device) \
            if self.device is not None and self.device.type == "cuda" else None
        while True:
            job = self._q.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                # inference mode is per thread: the caches may be inference tensors
                with torch.inference_mode():
                    if stream is None:
                        n = self.connector.load(job.block_hashes, job.block_ids)
                    else:
                        with torch.cuda.stream(stream):
                            n = self.connector.load(job.block_hashes, job.block_ids)
                job.loaded = max(0, min(int(n), len(job.block_ids)))
            except Exception as e:  # noqa: BLE001 - a failed load is a miss: the request computes
                log.exception("KV connector load of %d blocks failed; computing them",
                              len(job.block_ids))
                job.error, job.loaded = e, 0
                self.failures_total += 1
            finally:
                if stream is not None:
                    try:
                        stream.synchronize()  # no copy of this job may land after it is posted
                    except Exception:  # noqa: BLE001
                        log.exception("KV load stream sync failed")
            job.seconds = time.perf_counter() - t0
            self.loads_total += 1
            with self._cv:
                self._done.append(job)
                self._cv.notify_all()
            if self.notify is not None:
                self.notify()
