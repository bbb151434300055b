"""`kvyard up`: a local stack (N workers, the EPP, Envoy) left running in the background.

If a healthy stack already runs in the run dir, `up` reuses it and says so:
`make demo` twice in a row then costs nothing the second time. A stack that
is only partly alive (a crash) is stopped and started afresh. `--restart`
forces a fresh start.
"""
from __future__ import annotations

import argparse
import sys

from kvyard.kvstore.redis_conf import DEFAULT_MAX_MEMORY_BYTES
from kvyard.stack.launch import POOL_TIERS
from kvyard.stack.rundir import add_run_dir, kvyard_command, run_dir
from kvyard.workers.server.cli import parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--port", type=int, default=8080, help="gateway port (another free one if taken)")
    p.add_argument("--model", default="demo")
    p.add_argument("--dtype", default=None, help="worker dtype (passed to kvyard worker)")
    p.add_argument("--kv-pool-tier", choices=POOL_TIERS, default="ssd",
                   help="the kvstore tier all workers share, behind each one's DRAM tier: "
                        "ssd (a directory in the run dir; default), redis (a loopback, "
                        "password-protected redis-server: the path Kubernetes uses across "
                        "nodes) or none")
    p.add_argument("--kv-redis", dest="kv_pool_tier", action="store_const", const="redis",
                   help="same as --kv-pool-tier redis")
    p.add_argument("--kv-redis-max-memory", type=parse_size, default=DEFAULT_MAX_MEMORY_BYTES,
                   metavar="SIZE", help="the redis-server's maxmemory (allkeys-lru), e.g. 1GiB, "
                                        "512MiB (default 1GiB)")
    p.add_argument("--kv-tiers", action=argparse.BooleanOptionalAction, default=True,
                   help="give workers a kvstore at all (default on)")
    p.add_argument("--restart", action="store_true", help="stop a running stack first")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    # Model-free workers, for tests and routing benchmarks.
    p.add_argument("--standin-workers", action="store_true", help=argparse.SUPPRESS)
    add_run_dir(p)


def run(args: argparse.Namespace) -> int:
    from kvyard.stack.launch import StackSpec, StackState, stack_alive, start_stack, stop_stack
    from kvyard.stack.procs import StartupError

    rd = run_dir(args)
    old = StackState.load(rd)
    if old is not None:
        if not args.restart and old.gateway_url and stack_alive(old):
            spec = old.spec
            print(f"kvyard: a stack is already running in {rd} "
                  f"({spec.get('workers')} workers, model {spec.get('model')}); reusing it. "
                  f"Use `{kvyard_command()} up --restart` for a fresh one.")
            print(f"gateway: {old.gateway_url}")
            return 0
        print(f"kvyard: stopping the previous stack in {rd}", file=sys.stderr)
        stop_stack(old)
    from kvyard.stack.launch import redis_available

    if args.kv_tiers and args.kv_pool_tier == "redis" and not redis_available():
        print("kvyard up: --kv-pool-tier redis needs redis-server (apt-get install "
              "redis-server)", file=sys.stderr)
        return 1
    spec = StackSpec(run_dir=rd, workers=args.workers, gateway_port=args.port, model=args.model,
                     dtype=args.dtype, standin=args.standin_workers, ready_timeout_s=args.timeout,
                     kv_tiers=args.kv_tiers, kv_pool_tier=args.kv_pool_tier,
                     kv_redis_max_memory=args.kv_redis_max_memory)
    print(f"kvyard: starting {args.workers} worker(s), the EPP and Envoy (logs in {rd}/logs)",
          flush=True)
    try:
        state = start_stack(spec)
    except StartupError as e:
        print(f"kvyard up failed, everything stopped: {e}", file=sys.stderr)
        return 1
    for p in state.procs:
        print(f"  {p.name:<10} pid {p.pid:<8} {p.ports}")
    print(f"gateway: {state.gateway_url}")
    print(f"status: {kvyard_command()} status    stop: {kvyard_command()} down")
    return 0
