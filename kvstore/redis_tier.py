"""The shared remote tier: a real Redis (or Redis Cluster), values = header + payload.

Keys are `<prefix><namespace hex>:<hash hex>`; batches go out as one MGET and
one pipeline of SETs with the TTL. On a Redis Cluster a batch is split by
master (redis-py's slot map) and each master gets its own pipeline (GETs:
an MGET may not span slots) behind its own circuit breaker, so a dead master
costs only the keys it holds: the others keep being read and written. Capacity and LRU are Redis's own (`maxmemory` +
`maxmemory-policy allkeys-lru` on the server); `stats.bytes` is what this
client has written, an upper bound on what it holds there: TTL expiry, server
eviction and deletes of corrupt values are not observed.

Fail fast: short socket timeouts, redis-py's own retries off, and a circuit
breaker; while it is open every call is an immediate miss, so a dead Redis
never slows the engine, and the first trial after the backoff reconnects.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.exceptions import AskError, RedisClusterException
from redis.retry import Retry

from kvyard.kvstore.breaker import CircuitBreaker
from kvyard.kvstore.codec import CorruptBlock, decode
from kvyard.kvstore.layout import KVLayout
from kvyard.kvstore.redis_wire import mget_into, send_sets, zero_copy_packer
from kvyard.kvstore.stats import TierStats

GROUP_BYTES = 2 << 20  # put: checksums run this many bytes ahead of the send, on a helper
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
# what a failed call may raise: RedisClusterException (no reachable node, a slot
# not covered) is not a RedisError
FAILURES = (redis.RedisError, RedisClusterException, OSError)


class RedisTier:
    name = "redis"

    def __init__(self, url: str, *, password: str | None = None, prefix: str = "kvyard:kv:",
                 ttl_s: int | None = None, cluster: bool = False, timeout_s: float = 0.25,
                 backoff_s: tuple[float, float] = (0.5, 10.0)) -> None:
        scheme = urlsplit(url).scheme
        if scheme in CLUSTER_SCHEMES:  # redis+cluster://host:port selects RedisCluster
            cluster = True
            url = urlunsplit((CLUSTER_SCHEMES[scheme], *urlsplit(url)[1:]))
        self.url = url
        self.cluster = cluster
        self.prefix = prefix
        self.ttl_s = ttl_s or None
        self.stats = TierStats()
        where = urlsplit(url)
        self.where = f"{where.hostname}:{where.port or 6379}"  # never the password
        self.breaker = CircuitBreaker(*backoff_s, name=f"redis ({self.where})")
        self._backoff = backoff_s
        self._node_breakers: dict[str, CircuitBreaker] = {}  # cluster: one per master
        self._stale_slots = False  # cluster: refresh the slot map before the next call
        self._ahead: ThreadPoolExecutor | None = None  # checksums one group ahead (put)
        self.group_bytes = GROUP_BYTES  # per instance: tests and experiments vary it
        self._opts = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                          retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        if password is None:
            password = os.environ.get("KVYARD_REDIS_PASSWORD") or None
        if password is not None:
            self._opts["password"] = password
        self._client = None
        self._client_lock = threading.Lock()
        self._lock = threading.Lock()

    def _redis(self):
        """The client, created on first use: a RedisCluster connects in its constructor."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    if self.cluster:
                        from redis.cluster import RedisCluster
                        opts = {k: v for k, v in self._opts.items() if k != "retry_on_timeout"}
                        self._client = RedisCluster.from_url(self.url, **opts)
                    else:
                        self._client = redis.Redis.from_url(
                            self.url, command_packer=zero_copy_packer(), **self._opts)
        return self._client

    def rkey(self, key: bytes) -> bytes:
        return b"%s%s:%s" % (self.prefix.encode(), key[:16].hex().encode(), key[16:].hex().encode())

    def _call(self, fn):
        """Run `fn(client)` behind the breaker; (ok, result). Failures count an error."""
        if not self.breaker.allow():
            return False, None
        try:
            out = fn(self._redis())
        except FAILURES as e:
            self.breaker.failure(e)
            with self._lock:
                self.stats.errors += 1
            return False, None
        self.breaker.success()
        return True, out

    @property
    def available(self) -> bool:
        """Up as far as this client knows: its last call went through (`tier_up`). On a
        cluster, the client and its slot map; each master's loss is logged by name."""
        return not self.breaker.is_open

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        rkeys = [self.rkey(k) for k in keys]
        if self.cluster:
            return [bool(x) for x in self._per_node(rkeys, _pipelined("exists"))]
        ok, res = self._call(lambda r: _pipelined("exists")(r, rkeys))
        return [bool(x) for x in res] if ok else [False] * len(keys)

    # -- cluster: one pipeline per master, each behind its own breaker ---------------
    def _per_node(self, rkeys: list[bytes], fn, prepare=None) -> list:
        """`fn(node client, its rkeys, their indices)` per master holding some of `rkeys`;
        the results in key order, None for the keys of a master that failed or whose
        breaker is open (each failure counts one error). redis-py's own cluster calls
        fail a whole batch when one master is down; this keeps the others' answers."""
        out: list = [None] * len(rkeys)

        def route(r):
            if self._stale_slots:  # a MOVED/ASK or a dead master: the map may be old
                self._stale_slots = False
                r.nodes_manager.initialize()
            groups: dict[str, tuple[object, list[int]]] = {}
            try:
                for i, rk in enumerate(rkeys):
                    node = r.get_node_from_key(rk)
                    groups.setdefault(node.name, (node, []))[1].append(i)
            except RedisClusterException:  # a slot without a master in the map: re-read it
                self._stale_slots = True
                raise
            return r, groups
        ok, routed = self._call(route)  # the client and the slot map: the tier's breaker
        if not ok:
            return out
        r, groups = routed
        for name, (node, idx) in groups.items():
            with self._lock:
                br = self._node_breakers.get(name)
                if br is None:
                    br = self._node_breakers[name] = CircuitBreaker(
                        *self._backoff, name=f"redis master {name}")
            if not br.allow():
                continue
            try:
                res = fn(r.get_redis_connection(node), [rkeys[i] for i in idx], idx)
            except FAILURES as e:
                br.failure(e)
                with self._lock:
                    self.stats.errors += 1
                if not isinstance(e, redis.ResponseError) or isinstance(e, AskError):
                    self._stale_slots = True  # MOVED/ASK, or the master gone (a failover?)
                continue
            br.success()
            for i, v in zip(idx, res):
                out[i] = v
        return out

    def get_many(self, keys: Sequence[bytes], layout: KVLayout, mapper=map
                 ) -> list[tuple[memoryview, bytes] | None]:
        """(payload view, the whole framed value) per key, or None.

        `mapper` (e.g. a thread pool's map) runs the per-value checksums, which
        release the GIL, side by side."""
        vals = self.fetch(keys)
        return list(mapper(lambda kv: self.verify(kv[0], kv[1], layout), zip(keys, vals)))

    def fetch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Raw values in one round trip (MGET); all None while the tier is down."""
        rkeys = [self.rkey(k) for k in keys]
        if self.cluster:
            return self._per_node(rkeys, _pipelined("get"))
        ok, vals = self._call(lambda r: r.mget(rkeys))
        return vals if ok else [None] * len(keys)

    def fetch_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview], layout: KVLayout
                   ) -> list[bool]:
        """One MGET whose values are read from the socket straight into `dsts` (payload)
        and a small header buffer, then verified there while still in cache: no
        hiredis bytes object, no second copy. True per verified hit; a miss or a
        corrupt value is False (counted; corrupt ones deleted, their dst zeroed).
        On a cluster, pipelined GETs per master the same way (a master that fails
        answers misses). A value of unexpected length goes through `verify`."""
        rkeys = [self.rkey(k) for k in keys]
        if self.cluster:
            ok, out = True, self._per_node(rkeys, lambda c, rks, idx: mget_into(
                c, rks, [keys[i] for i in idx], [dsts[i] for i in idx], layout, single_gets=True))
        else:
            ok, out = self._call(lambda r: mget_into(r, rkeys, keys, dsts, layout))
        if not ok:
            with self._lock:
                self.stats.misses += len(keys)
            return [False] * len(keys)
        corrupt = [rkeys[i] for i, st in enumerate(out) if isinstance(st, CorruptBlock)]
        hits = misses = bad = 0
        for i, st in enumerate(out):
            if st is True:
                hits += 1
            elif st is None:
                misses += 1
            elif isinstance(st, bytes):  # unexpected length: the general path decides
                out[i] = self._verify_copy(keys[i], st, dsts[i], layout)
                continue
            else:  # corrupt (a CorruptBlock)
                bad += 1
                np.frombuffer(dsts[i], dtype=np.uint8)[:] = 0
            out[i] = st is True
        with self._lock:
            self.stats.hits += hits
            self.stats.misses += misses + bad
            self.stats.errors += bad
        if corrupt:
            self._delete(corrupt)
        return out

    def _verify_copy(self, key: bytes, value, dst: memoryview, layout: KVLayout) -> bool:
        got = self.verify(key, value, layout)
        if got is not None:
            np.frombuffer(dst, dtype=np.uint8)[:] = np.frombuffer(got[0], dtype=np.uint8)
        return got is not None

    def verify(self, key: bytes, value: bytes | None, layout: KVLayout
               ) -> tuple[memoryview, bytes] | None:
        """A fetched value's payload, counted as hit or miss; corrupt ones are deleted."""
        if value is not None:
            try:
                out = (decode(value, key, layout), value)
            except CorruptBlock:
                with self._lock:
                    self.stats.errors += 1
                    self.stats.misses += 1
                self._delete([self.rkey(key)])
                return None
            with self._lock:
                self.stats.hits += 1
            return out
        with self._lock:
            self.stats.misses += 1
        return None

    def put_many(self, items: Sequence[tuple[bytes, object]], prepare=None) -> bool:
        """items: (key, framed value: header + payload in one buffer, sent without a copy),
        in one pipelined round trip: every SET is written, then every reply read.

        `prepare(i, on_sender)`, when given, runs before value i goes out (the store
        fills the header there; `on_sender`: on the sending thread) as the send
        proceeds, a group ahead (`_prepared`), not for the whole batch up front: a
        batch checksummed first is cold again by the time it is sent, so every byte
        is read from memory twice (measured: see docs/benchmarks.md, kvstore)."""
        rkeys = [self.rkey(k) for k, _ in items]
        values = [memoryview(v).cast("B") for _, v in items]
        if self.cluster:
            done = self._per_node(rkeys, lambda c, rks, idx: send_sets(
                c, rks, self._prepared(idx, [values[i] for i in idx], prepare), self.ttl_s))
            sent = sum(v.nbytes for v, d in zip(values, done) if d is not None)
            ok = all(d is not None for d in done)
        else:
            ok, _ = self._call(lambda r: send_sets(
                r, rkeys, self._prepared(list(range(len(rkeys))), values, prepare), self.ttl_s))
            sent = sum(v.nbytes for v in values) if ok else 0
        with self._lock:
            self.stats.bytes += sent
        return ok

    def _prepared(self, idx: list[int], values: list[memoryview], prepare):
        """`values` in order, each yielded once `prepare(i, on_sender)` has run for it.

        Checksums run on a helper thread one group of about `GROUP_BYTES` ahead of
        the send: a group's hash (GIL-free) overlaps the previous group's send. The
        first group is prepared on the sender itself while the helper starts on the
        second. Groups rather than single values: a thread hand-off per value costs
        more than the hash of a sub-MiB block, while a group of about 2 MiB carries
        the hand-off for every block size, so small and large blocks take the same
        path (measured: see docs/benchmarks.md, kvstore). A batch of one group has
        nothing to overlap: it stays inline."""
        if prepare is None:
            yield from values
            return
        per = max(1, self.group_bytes // max(1, values[0].nbytes)) if values else 1

        def run(lo: int) -> None:
            for j in range(lo, min(lo + per, len(values))):
                prepare(idx[j], False)
        nxt = self._helper().submit(run, per) if len(values) > per else None
        try:
            for j in range(min(per, len(values))):  # the first group: on the sender
                prepare(idx[j], True)
                yield values[j]
            for lo in range(per, len(values), per):
                nxt.result()
                nxt = self._helper().submit(run, lo + per) if lo + per < len(values) else None
                yield from values[lo:lo + per]
        finally:
            if nxt is not None:  # a send failed: let the pending headers finish first
                nxt.result()

    def _helper(self) -> ThreadPoolExecutor:
        if self._ahead is None:
            with self._lock:
                if self._ahead is None:
                    self._ahead = ThreadPoolExecutor(1, thread_name_prefix="kvstore-redis-hash")
        return self._ahead

    def _delete(self, rkeys: list[bytes]) -> None:
        if self.cluster:
            self._per_node(rkeys, _pipelined("delete"))
        else:
            self._call(lambda r: _pipelined("delete")(r, rkeys))

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - closing a dead connection may raise anything
                pass


def _pipelined(command: str):
    """`run(client, rkeys, idx=None)`: one command per key in one non-transactional
    pipeline, the replies in key order (the first error reply raises)."""
    def run(client, rkeys: list[bytes], idx=None) -> list:
        p = client.pipeline(transaction=False)
        for rk in rkeys:
            getattr(p, command)(rk)
        return p.execute()
    return run


