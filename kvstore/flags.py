"""The `--kv-*` flags and the StoreConfig they make.

Here rather than in the worker's connector so that processes without torch
(the local stack's stand-in workers) configure their store with exactly the
flags a real worker takes; `kvyard.workers.kvconnector` re-exports both.
"""
from __future__ import annotations

import argparse
import os

from kvyard.kvstore.store import StoreConfig

_GB = 10**9


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("kvstore (external KV-block cache; off unless a tier is set)")
    g.add_argument("--kv-dram-gb", type=float, default=0.0,
                   help="in-process DRAM tier capacity, GB (10^9 bytes)")
    g.add_argument("--kv-ssd-dir", default=None,
                   help="SSD tier directory (may be shared by workers on one node)")
    g.add_argument("--kv-ssd-gb", type=float, default=0.0, help="SSD tier capacity, GB")
    g.add_argument("--kv-ssd-fsync", action="store_true",
                   help="fsync every block file (durable across power loss; slower)")
    g.add_argument("--kv-redis-url", default=None,
                   help="redis://[:password@]host:port/db, or redis+cluster://host:port")
    g.add_argument("--kv-redis-password", default=None,
                   help="Redis password when not in the URL (default $KVYARD_REDIS_PASSWORD)")
    g.add_argument("--kv-redis-prefix", default="kvyard:kv:", help="key prefix in Redis")
    g.add_argument("--kv-redis-ttl", type=int, default=None, help="seconds a block lives in Redis")
    g.add_argument("--kv-redis-cluster", action="store_true",
                   help="use Redis Cluster (also implied by a redis+cluster:// URL)")
    g.add_argument("--kv-queue-blocks", type=int, default=1024,
                   help="writer queue bound; writes beyond it are dropped, never waited for")


def store_config(args: argparse.Namespace) -> StoreConfig:
    ssd_dir = getattr(args, "kv_ssd_dir", None)
    ssd_gb = getattr(args, "kv_ssd_gb", 0.0) or 0.0
    if ssd_dir and ssd_gb <= 0:
        raise ValueError("--kv-ssd-dir needs --kv-ssd-gb (the tier's capacity)")
    return StoreConfig(
        dram_bytes=int((getattr(args, "kv_dram_gb", 0.0) or 0.0) * _GB),
        ssd_dir=ssd_dir, ssd_bytes=int(ssd_gb * _GB),
        ssd_fsync=bool(getattr(args, "kv_ssd_fsync", False)),
        redis_url=getattr(args, "kv_redis_url", None),
        redis_password=getattr(args, "kv_redis_password", None)
        or os.environ.get("KVYARD_REDIS_PASSWORD") or None,
        redis_prefix=getattr(args, "kv_redis_prefix", "kvyard:kv:"),
        redis_ttl_s=getattr(args, "kv_redis_ttl", None),
        redis_cluster=bool(getattr(args, "kv_redis_cluster", False)),
        queue_blocks=getattr(args, "kv_queue_blocks", 1024))
