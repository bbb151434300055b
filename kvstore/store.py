"""The tiered store: DRAM ▸ SSD ▸ Redis, write-through, reads promote upward.

`put` never blocks the engine: DRAM takes the buffer at once (no copy), and
the slower tiers are fed through a bounded queue by a writer thread (headers,
SSD files) and a sender thread (Redis), so one batch's checksums overlap the
previous batch's network time; when the queue is full the write to SSD/Redis
is dropped and counted, never waited for. `get` tries the tiers fastest first; a hit below DRAM is promoted
into DRAM (and a Redis hit into SSD, through the writer). `lookup` answers how
many leading blocks are available anywhere, with the tier of each.

Ownership: buffers passed to `put` belong to the store afterwards (the caller
must not mutate them); views returned by `get` are read-only and stay valid
as long as the caller holds them, whatever the store evicts meanwhile.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvyard.kvstore.codec import HEADER_BYTES, encode_header
from kvyard.kvstore.dram import DramTier
from kvyard.kvstore.layout import Namespace
from kvyard.kvstore.malloc import tune_malloc
from kvyard.kvstore.redis_tier import RedisTier
from kvyard.kvstore.ssd import SsdTier
from kvyard.kvstore.writeq import WriteQueue

_BATCH = 64  # blocks per writer round: one Redis pipeline, one queue drain
_FETCH_PART = 16  # blocks per MGET when a get's fetches overlap its checksums


def _copy(dst: memoryview, src: memoryview) -> None:
    """memcpy through numpy, which releases the GIL (a memoryview assignment does not)."""
    np.frombuffer(dst, dtype=np.uint8)[:] = np.frombuffer(src, dtype=np.uint8)


@dataclass(slots=True)
class StoreConfig:
    """Capacities in bytes; a tier with no capacity (or no dir/URL) is off."""

    dram_bytes: int = 0
    ssd_dir: str | None = None
    ssd_bytes: int = 0
    ssd_fsync: bool = False
    redis_url: str | None = None
    redis_password: str | None = None
    redis_prefix: str = "kvyard:kv:"
    redis_ttl_s: int | None = None
    redis_cluster: bool = False
    redis_timeout_s: float = 0.25
    queue_blocks: int = 1024
    io_threads: int = 4

    @property
    def any_tier(self) -> bool:
        return bool(self.dram_bytes > 0 or (self.ssd_dir and self.ssd_bytes > 0) or self.redis_url)


class KVStore:
    def __init__(self, namespace: Namespace, *, dram: DramTier | None = None,
                 ssd: SsdTier | None = None, redis: RedisTier | None = None,
                 queue_blocks: int = 1024, io_threads: int = 4) -> None:
        self.namespace = namespace
        tune_malloc()  # block-sized buffers churn: keep freed ones warm (see malloc.py)
        # Parallel block I/O and checksums (both release the GIL): a page-cache or
        # NVMe read, and a checksum pass, each run far below memory or device
        # bandwidth on one core, so a few threads are what reach it.
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-io") \
            if io_threads > 1 and (ssd is not None or redis is not None) else None
        self.layout = namespace.layout
        self.dram, self.ssd, self.redis = dram, ssd, redis
        self.tiers = {t.name: t for t in (dram, ssd, redis) if t is not None}
        self.dropped_writes = 0
        self._q = WriteQueue(queue_blocks)
        self._writer: threading.Thread | None = None
        self._sendq: queue.Queue | None = None
        if redis is not None:  # two batches in flight at most: bounded memory
            self._sendq = queue.Queue(maxsize=1)
            threading.Thread(target=self._send_loop, name="kvstore-sender", daemon=True).start()
        if ssd is not None or redis is not None:
            self._writer = threading.Thread(target=self._write_loop, name="kvstore-writer",
                                            daemon=True)
            self._writer.start()

    @classmethod
    def from_config(cls, namespace: Namespace, cfg: StoreConfig) -> "KVStore":
        dram = DramTier(cfg.dram_bytes) if cfg.dram_bytes > 0 else None
        ssd = SsdTier(cfg.ssd_dir, cfg.ssd_bytes, fsync=cfg.ssd_fsync) \
            if cfg.ssd_dir and cfg.ssd_bytes > 0 else None
        red = RedisTier(cfg.redis_url, password=cfg.redis_password, prefix=cfg.redis_prefix,
                        ttl_s=cfg.redis_ttl_s, cluster=cfg.redis_cluster,
                        timeout_s=cfg.redis_timeout_s) if cfg.redis_url else None
        return cls(namespace, dram=dram, ssd=ssd, redis=red, queue_blocks=cfg.queue_blocks,
                   io_threads=cfg.io_threads)

    # -- writes --------------------------------------------------------------
    def put(self, block_hashes: Sequence[int], blocks: Sequence[object]) -> int:
        """Store blocks; returns how many were kept (DRAM) or queued for SSD/Redis.

        A block is either its payload (`layout.nbytes`) or a framed, writable
        buffer (`HEADER_BYTES` + payload) whose header the writer fills in place.
        """
        keys = self.namespace.keys(block_hashes)
        nbytes = self.layout.nbytes
        accepted = 0
        queued = []
        for key, blk in zip(keys, blocks, strict=True):
            mv = memoryview(blk).cast("B")
            frame = None
            if mv.nbytes == HEADER_BYTES + nbytes and not mv.readonly:
                frame, mv = mv, mv[HEADER_BYTES:]
            elif mv.nbytes != nbytes:
                raise ValueError(f"block is {mv.nbytes} bytes, layout needs {nbytes} "
                                 f"(or {HEADER_BYTES + nbytes} framed)")
            if self.dram is not None:
                self.dram.put(key, mv)
            if self._writer is None:
                accepted += 1
            else:
                queued.append((key, mv, frame, True))
        if queued:
            taken = self._q.offer(queued)
            accepted += taken
            self.dropped_writes += len(queued) - taken
        return accepted

    def _write_loop(self) -> None:
        """Stage 1 of the write pipeline: headers (checksums) and SSD files for a batch,
        while the sender thread still ships the previous batch to Redis. Without an
        SSD tier, a caller's frame gets its header in the sender's pipeline, a group
        ahead of its send (see `RedisTier.put_many`), not here a batch ahead: that
        would make two cold passes over each block (hash here, socket copy there),
        which cost more than they overlap when the raw send already keeps the cores
        busy (measured: see docs/benchmarks.md, kvstore)."""
        while True:
            batch = self._q.take(_BATCH)
            if batch is None:  # closed and drained
                if self._sendq is not None:
                    self._sendq.put(None)
                return
            handed = False
            try:
                early, late = [], []
                for it in batch:
                    framed = it[2] is not None and not it[2].readonly
                    (late if framed and self.ssd is None else early).append(it)
                written = self._map(self._encode_and_write, early, big_only=self.ssd is None)
                remote = [(it[0], bufs[0] if len(bufs) == 1 else b"".join(bufs))
                          for it, bufs in zip(early, written) if it[3]]
                remote += [(it[0], it[2]) for it in late]
                if self._sendq is not None and remote:
                    self._sendq.put((remote, late, len(batch)))  # the sender marks them done
                    handed = True
            finally:
                if not handed:
                    self._q.done(len(batch))

    def _send_loop(self) -> None:
        """Stage 2: one pipelined round trip of SETs per batch; the headers of `late`
        frames (the last entries of `remote`) are filled value by value as they go."""
        while True:
            job = self._sendq.get()
            if job is None:
                return
            remote, late, n = job
            first = len(remote) - len(late)

            def prepare(i, on_sender):
                if i >= first:  # on the sender the checksum keeps the GIL (see checksum)
                    key, payload, frame, _ = late[i - first]
                    frame[:HEADER_BYTES] = encode_header(key, self.layout, payload, on_sender)
            try:
                self.redis.put_many(remote, prepare if late else None)
            finally:
                self._q.done(n)

    def _map(self, fn, items: list, big_only: bool = False) -> list:
        """`fn` over items on the I/O threads. Threads pay off for file I/O and for
        checksums of big blocks; for sub-MiB blocks without file I/O their GIL
        hand-offs cost more than they save (measured on Redis gets: see
        docs/benchmarks.md, kvstore), hence `big_only`."""
        if self._pool is None or len(items) < 2 or (big_only and self.layout.nbytes < 1 << 20):
            return [fn(x) for x in items]
        return list(self._pool.map(fn, items))

    def _encode_and_write(self, item: tuple[bytes, memoryview, object, bool]) -> list:
        """One block: header (checksum) and, if there is an SSD, its file."""
        key, payload, frame, _ = item
        if frame is not None and frame.readonly:  # a Redis value: it carries its header
            bufs = [frame]
        else:
            header = encode_header(key, self.layout, payload)
            if frame is not None:  # a caller's frame gets its header in place
                frame[:HEADER_BYTES] = header
                bufs = [frame]
            else:
                bufs = [header, payload]
        if self.ssd is not None:
            self.ssd.put(key, bufs)
        return bufs

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write has reached its tiers (tests, benchmarks, shutdown)."""
        return self._q.join(timeout)

    wait_idle = flush

    # -- reads ---------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[int]) -> tuple[int, list[str]]:
        """(length of the longest leading run of blocks present, the tier of each)."""
        keys = self.namespace.keys(block_hashes)
        tiers: list[str | None] = []
        unresolved: list[int] = []
        remote = self.redis is not None and self.redis.breaker.ready()
        for i, k in enumerate(keys):
            if self.dram is not None and self.dram.contains(k):
                tiers.append("dram")
            elif self.ssd is not None and self.ssd.contains(k):
                tiers.append("ssd")
            else:
                tiers.append(None)
                unresolved.append(i)
                if not remote:
                    break
        if unresolved and remote:
            for i, there in zip(unresolved, self.redis.contains_many([keys[i] for i in unresolved])):
                if there:
                    tiers[i] = "redis"
        n = 0
        while n < len(tiers) and tiers[n] is not None:
            n += 1
        return n, tiers[:n]

    def _promote(self, key: bytes, payload: memoryview, frame: bytes | None) -> None:
        """Copy a lower-tier hit upward: DRAM keeps the (immutable) view; a Redis
        hit's framed value goes to SSD through the writer as is."""
        if self.dram is not None:
            self.dram.put(key, payload)
        if frame is not None and self.ssd is not None:
            if not self._q.offer([(key, payload, memoryview(frame), False)]):
                self.dropped_writes += 1

    def get(self, block_hashes: Sequence[int]) -> list[memoryview | None]:
        """Each block's payload (read-only view) or None; faster tiers first, hits promoted."""
        keys = self.namespace.keys(block_hashes)
        out: list[memoryview | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        if self.dram is not None:
            for i in missing:
                out[i] = self.dram.get(keys[i])
            missing = [i for i in missing if out[i] is None]
        if self.ssd is not None and missing:
            for i in missing:
                got = self.ssd.get(keys[i], self.layout)
                if got is not None:
                    out[i] = got[0]
                    self._promote(keys[i], got[0], None)
            missing = [i for i in missing if out[i] is None]
        if self.redis is not None and missing:
            for i, v in zip(missing, self.redis.get_many([keys[i] for i in missing], self.layout)):
                if v is not None:
                    out[i] = v[0]
                    self._promote(keys[i], *v)
        return out

    def dram_views(self, block_hashes: Sequence[int], accept=None) -> list[memoryview]:
        """The leading run of blocks the DRAM tier holds (and `accept(view)` takes): their
        payload views, uncopied, each counted a DRAM hit; empty without a DRAM tier.
        For callers that can read the tier's memory in place: the CUDA connector
        copies pinned frames straight to the GPU. The views keep the bytes alive,
        whatever the tier evicts meanwhile."""
        out: list[memoryview] = []
        if self.dram is None:
            return out
        for k in self.namespace.keys(block_hashes):
            mv = self.dram.get(k, accept)
            if mv is None:
                break
            out.append(mv)
        return out

    def get_into(self, block_hashes: Sequence[int], outs: Sequence[object]) -> int:
        """Fill `outs[i]` (writable, `layout.nbytes` each) with the leading blocks, in
        order, up to the first block no tier has; returns how many were filled.

        The copy-free path for callers that own the destination: SSD reads land
        in `outs` directly, several at once. An SSD hit reaches DRAM only as a
        copy (a pass over the bytes), done only when there is a DRAM tier.
        """
        keys = self.namespace.keys(block_hashes)[:len(outs)]
        dsts = [memoryview(o).cast("B") for o in outs[:len(keys)]]
        filled = [False] * len(keys)
        todo = list(range(len(keys)))
        if self.dram is not None:
            for i in todo:
                mv = self.dram.get(keys[i])
                if mv is not None:
                    _copy(dsts[i], mv)
                    filled[i] = True
            todo = [i for i in todo if not filled[i]]
        if self.ssd is not None and todo:
            ok = self._map(lambda i: self.ssd.read_into(keys[i], self.layout, dsts[i]), todo)
            for i, hit in zip(todo, ok):
                filled[i] = hit
                if hit and self.dram is not None:
                    self.dram.put(keys[i], bytes(dsts[i]))
            todo = [i for i in todo if not filled[i]]
        if self.redis is not None and todo and self.dram is None and self.ssd is None:
            # nothing to promote into: values are read from the socket straight into
            # `outs` and verified there (RedisTier.fetch_into), no intermediate copy
            for part, hits in self._fetches(todo, lambda p: self.redis.fetch_into(
                    [keys[i] for i in p], [dsts[i] for i in p], self.layout)):
                for i, hit in zip(part, hits):
                    filled[i] = hit
        elif self.redis is not None and todo:
            def verify_copy(iv):  # checksum + copy out, several at once
                i, v = iv
                got = self.redis.verify(keys[i], v, self.layout)
                if got is not None:
                    _copy(dsts[i], got[0])
                return got
            for part, vals in self._fetches(todo, lambda p: self.redis.fetch(
                    [keys[i] for i in p])):
                for i, got in zip(part, self._map(verify_copy, list(zip(part, vals)),
                                                  big_only=True)):
                    if got is not None:
                        filled[i] = True
                        self._promote(keys[i], *got)
        n = 0
        while n < len(filled) and filled[n]:
            n += 1
        return n

    def _fetches(self, todo: list[int], fetch):
        """(indices, fetch(indices)) per MGET. With I/O threads a batch is fetched in parts,
        the next part in flight (its own connection) while the caller verifies and copies
        out this one, so checksums and copies overlap the network instead of following it."""
        if self._pool is None or len(todo) < 2 * _FETCH_PART:
            yield todo, fetch(todo)
            return
        parts = [todo[s:s + _FETCH_PART] for s in range(0, len(todo), _FETCH_PART)]
        nxt = self._pool.submit(fetch, parts[0])
        for k, part in enumerate(parts):
            vals = nxt.result()
            if k + 1 < len(parts):
                nxt = self._pool.submit(fetch, parts[k + 1])
            yield part, vals

    # -- async twins (the server's event loop must not block on disk or network) --
    async def aput(self, block_hashes: Sequence[int], blocks: Sequence[object]) -> int:
        return await asyncio.to_thread(self.put, block_hashes, blocks)

    async def alookup(self, block_hashes: Sequence[int]) -> tuple[int, list[str]]:
        return await asyncio.to_thread(self.lookup, block_hashes)

    async def aget(self, block_hashes: Sequence[int]) -> list[memoryview | None]:
        return await asyncio.to_thread(self.get, block_hashes)

    async def aflush(self, timeout: float = 30.0) -> bool:
        return await asyncio.to_thread(self.flush, timeout)

    # -- housekeeping --------------------------------------------------------
    def stats(self) -> dict[str, dict[str, int]]:
        return {name: t.stats.as_dict() for name, t in self.tiers.items()}

    def close(self, timeout: float = 30.0) -> None:
        if self._writer is not None and self._writer.is_alive():
            flushed = self.flush(timeout)
            self._q.close()
            if flushed:  # else a writer stuck on a dead disk: it is a daemon, leave it
                self._writer.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.redis is not None:
            self.redis.close()
