"""The settings every Redis that kvyard starts or configures gets, in one place.

A block cache must be bounded: without `maxmemory` Redis keeps every value it is
sent and grows with the traffic, without limit (see docs/benchmarks.md,
kvstore), and with any other policy than `allkeys-lru` a full Redis answers
SETs with OOM errors instead of dropping its coldest blocks. The local stack
(`kvyard up`), the test and benchmark servers (`redis_server.py`) and the Helm
chart all take their cap from `DEFAULT_MAX_MEMORY_BYTES` unless told otherwise.

Scratch servers also persist nothing and listen on loopback only, behind a
password: a cache that dies with the stack.
"""
from __future__ import annotations

DEFAULT_MAX_MEMORY_BYTES = 1 << 30  # 1 GiB
EVICTION_POLICY = "allkeys-lru"


def cache_directives(max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES) -> list[tuple[str, str]]:
    """What makes Redis a bounded cache: a byte cap and LRU eviction over all keys."""
    if max_memory_bytes <= 0:
        raise ValueError("a Redis block cache needs a positive maxmemory")
    return [("maxmemory", str(int(max_memory_bytes))), ("maxmemory-policy", EVICTION_POLICY)]


def scratch_directives(port: int, password: str,
                       max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES) -> list[tuple[str, str]]:
    """A private cache: loopback, password, no RDB/AOF, bounded with LRU eviction."""
    return [("port", str(port)), ("bind", "127.0.0.1"), ("protected-mode", "yes"),
            ("save", '""'), ("appendonly", "no"), ("requirepass", password),
            *cache_directives(max_memory_bytes)]


def conf_text(directives: list[tuple[str, str]]) -> str:
    """redis.conf lines (values here never contain spaces: tokens and numbers)."""
    return "".join(f"{k} {v}\n" for k, v in directives)


def cli_args(directives: list[tuple[str, str]]) -> list[str]:
    """The same directives as redis-server arguments (`--save ""` is an empty argument)."""
    out: list[str] = []
    for k, v in directives:
        out += [f"--{k}", "" if v == '""' else v]
    return out
