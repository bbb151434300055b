"""The shared remote tier: a real Redis (or Redis Cluster), values = header + payload.

Keys are `<prefix><namespace hex>:<hash hex>`; batches go out as one MGET (or
`mget_nonatomic` on a cluster, whose keys span slots) and one pipeline of
SETs with the TTL. Capacity and LRU are Redis's own (`maxmemory` +
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
from typing import Sequence
from urllib.parse import urlsplit, urlunsplit

import redis
from redis._parsers import Encoder
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.retry import Retry

from kvyard.kvstore.breaker import CircuitBreaker
from kvyard.kvstore.codec import CorruptBlock, decode
from kvyard.kvstore.layout import KVLayout
from kvyard.kvstore.stats import TierStats

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def zero_copy_packer() -> PythonRespSerializer:
    """redis-py's pure-Python RESP packer, which sends a memoryview argument as a
    chunk of its own, uncopied. Once hiredis is installed redis-py packs with
    hiredis instead, which copies every value twice (`bytes()`, then
    `pack_command`): measured 4x slower pipelined SETs of 360 KiB values.
    Replies still parse with hiredis (2x faster MGETs than the Python parser)."""
    return PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


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
        self.breaker = CircuitBreaker(*backoff_s)
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
        except (redis.RedisError, OSError):
            self.breaker.failure()
            with self._lock:
                self.stats.errors += 1
            return False, None
        self.breaker.success()
        return True, out

    @property
    def available(self) -> bool:
        return not self.breaker.is_open

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        def run(r):
            p = r.pipeline(transaction=False)
            for k in keys:
                p.exists(self.rkey(k))
            return p.execute()
        ok, res = self._call(run)
        return [bool(x) for x in res] if ok else [False] * len(keys)

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
        ok, vals = self._call(
            lambda r: r.mget_nonatomic(rkeys) if self.cluster else r.mget(rkeys))
        return vals if ok else [None] * len(keys)

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

        `prepare(i)`, when given, runs just before value i goes out (the store fills
        the header there): its checksum pass leaves the bytes in cache for the socket
        copy that follows, where a batch checksummed up front is cold again by then
        (measured: 0.96 vs 0.91 of raw pipelined SETs of 360 KiB values)."""
        values = [(self.rkey(k), memoryview(v).cast("B")) for k, v in items]
        ex = ("EX", self.ttl_s) if self.ttl_s else ()

        def run(r):
            if self.cluster:  # keys span nodes: redis-py's cluster pipeline routes them
                for i in range(len(values) if prepare is not None else 0):
                    prepare(i)
                p = r.pipeline(transaction=False)
                for rk, v in values:
                    p.set(rk, v, ex=self.ttl_s)
                return p.execute()
            pool = r.connection_pool
            conn = pool.get_connection()
            try:
                # packed as redis-py's pipeline packs (small pieces merged, each value a
                # chunk of its own, uncopied), sent up to and including each value
                group, i = [], 0
                for chunk in conn.pack_commands([("SET", rk, v, *ex) for rk, v in values]):
                    group.append(chunk)
                    if isinstance(chunk, memoryview):
                        if prepare is not None:
                            prepare(i)
                        i += 1
                        conn.send_packed_command(group, check_health=False)
                        group = []
                if group:
                    conn.send_packed_command(group, check_health=False)
                return [conn.read_response() for _ in values]  # an error reply raises
            except BaseException:
                conn.disconnect()  # replies may be left unread: never reuse it
                raise
            finally:
                pool.release(conn)
        ok, _ = self._call(run)
        if ok:
            with self._lock:
                self.stats.bytes += sum(v.nbytes for _, v in values)
        return ok

    def _delete(self, rkeys: list[bytes]) -> None:
        def run(r):
            p = r.pipeline(transaction=False)
            for rk in rkeys:
                p.delete(rk)
            return p.execute()
        self._call(run)

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - closing a dead connection may raise anything
                pass
