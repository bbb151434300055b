"""`kvyard up`: a local stack (N workers, the EPP, Envoy) left running in the background,
under a supervisor that restarts whatever dies.

If a healthy stack already runs in the run dir, `up` reuses it and says so:
`make demo` twice in a row then costs nothing the second time. A stack that
is only partly alive (a crash the supervisor could not mend, or the supervisor
itself gone) is stopped and started afresh. `--restart` forces a fresh start.

The stack is started by a forked, detached child, which then execs the
supervisor (`kvyard.stack.supervise`): so the supervisor is the parent of every
process it watches and sees their real exit statuses. `up` itself waits for the
child's word (ready, or the error) and returns.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from pathlib import Path

from kvyard.kvstore.redis_conf import DEFAULT_MAX_MEMORY_BYTES
from kvyard.stack.spec import POOL_TIERS
from kvyard.stack.rundir import add_run_dir, kvyard_command, run_dir
from kvyard.workers.server.cli import parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="colocated (role both) workers")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="P/D: N prefill workers (with --decode: instead of --workers)")
    p.add_argument("--decode", type=int, default=0, metavar="M",
                   help="P/D: M decode workers; the EPP runs the decode-first P/D config and "
                        "signs prefill targets with a key made for this stack")
    p.add_argument("--port", type=int, default=8080, help="gateway port (another free one if taken)")
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]SOURCE",
                   help="the workers' model (default demo); repeated as NAME=SOURCE: a pool of "
                        "--workers per model behind the one gateway, served under NAME")
    p.add_argument("--adapter", action="append", default=None, metavar="[MODEL:]NAME=PATH",
                   help="a LoRA adapter (PEFT directory) the model's workers serve as NAME "
                        "(MODEL: a --model NAME; default the first model); repeatable")
    p.add_argument("--max-loras", type=int, default=4,
                   help="with --adapter: adapters active at once per worker (vLLM's flag)")
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
    p.add_argument("--scale-to-zero", action="store_true",
                   help="an autoscaler (a KEDA client of the EPP's scaler) takes the workers "
                        "to zero after --idle-seconds without work and starts them again when "
                        "a request arrives (it waits in the EPP meanwhile); up to --workers")
    p.add_argument("--idle-seconds", type=float, default=300.0,
                   help="scale to zero after this long idle (KEDA's cooldownPeriod; default 300)")
    p.add_argument("--polling-seconds", type=float, default=5.0,
                   help="the autoscaler's poll (KEDA's pollingInterval): scale-down and 1..N "
                        "decisions; a request at zero wakes a worker at once (default 5)")
    p.add_argument("--max-workers", type=int, default=None, metavar="M",
                   help="with --scale-to-zero: start --workers, scale up to M (default: "
                        "--workers)")
    p.add_argument("--scaler-metadata", action="append", default=[], metavar="KEY=VALUE",
                   help="with --scale-to-zero: more scalerMetadata for the EPP's scaler, e.g. "
                        "targetValue=0.8, signal=backlog, leadMs=90000 (repeatable)")
    p.add_argument("--epp-config", default=None, metavar="FILE",
                   help="the EPP's scheduler config (colocated pools; e.g. with the latency "
                        "scorer, whose arrival forecast the scaler's predictive signal reads)")
    p.add_argument("--prestart", action=argparse.BooleanOptionalAction, default=True,
                   help="with --scale-to-zero: keep one spare interpreter (torch and the "
                        "worker's modules imported; no model, no KV cache) that becomes the "
                        "next worker, so a wake-up skips the imports (default on)")
    p.add_argument("--restart", action="store_true", help="stop a running stack first")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    p.add_argument("--sim", type=int, default=0, metavar="N",
                   help="N simulated pods (kvyard sim: the worker's protocol, a latency model "
                        "instead of the model) instead of workers; with --prefill K, K of them "
                        "prefill and N-K decode")
    p.add_argument("--sim-profile", default="cpu-demo",
                   help="the pods' latency profile: cpu-demo, h100, h200 or a JSON file "
                        "(kvyard sim calibrate)")
    p.add_argument("--sim-kv-cache-size", type=int, default=4096, metavar="BLOCKS",
                   help="each simulated pod's KV cache, in blocks of 16 tokens")
    p.add_argument("--sim-args", default="", metavar="'FLAGS'",
                   help="more `kvyard sim serve` flags for every pod, e.g. '--time-scale 10 "
                        "--zmq-endpoint tcp://*:5557' (endpoint ports go up by one per pod)")
    p.add_argument("--epp-replicas", type=int, default=1, metavar="N",
                   help="N active-active EPPs behind Envoy, sharing their picks so they route "
                        "as one (Envoy balances ext_proc streams and retries a failed one on "
                        "another replica)")
    p.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=True,
                   help="each worker publishes its KV events and the EPP routes by them "
                        "(precise prefix routing; default on). Off: the EPP's prefix scores "
                        "come from its own picks only")
    # Model-free workers, for tests and routing benchmarks.
    p.add_argument("--standin-workers", action="store_true", help=argparse.SUPPRESS)
    add_run_dir(p)


def _sim_counts(args: argparse.Namespace) -> str | None:
    """`--sim N [--prefill K]` as the workers/prefill/decode counts; the error, if any."""
    if not args.sim:
        return None
    if args.sim < 1 or args.decode or args.prefill < 0 or args.prefill >= args.sim:
        return "--sim N needs N >= 1; with --prefill K, 1 <= K < N (the rest decode)"
    if args.prefill:
        args.decode = args.sim - args.prefill
    else:
        args.workers = args.sim
    return None


def start_supervised(spec) -> str | None:
    """Start the stack from a detached child that becomes its supervisor; None once
    it is ready, else the error (with the failing log's tail)."""
    from kvyard.stack import supervise

    logs = spec.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()  # non-inheritable: closed by the exec, which is the parent's EOF
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(r)
            _become_supervisor(spec, w, logs / supervise.LOG_NAME)
        except BaseException as e:  # noqa: BLE001 - reported to the parent, then exit
            msg = str(e) or type(e).__name__
            try:
                os.write(w, b"error:" + msg.encode(errors="replace"))
            except OSError:
                pass
        os._exit(1)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        try:
            word = fh.read().decode(errors="replace")
        except KeyboardInterrupt:
            os.kill(pid, signal.SIGTERM)  # the child stops what it started
            raise
    if word == "ok":
        return None
    return word.removeprefix("error:") or "the starting process died (see logs/supervisor.log)"


def _become_supervisor(spec, w: int, log_path) -> None:
    from kvyard.stack import supervise
    from kvyard.stack.launch import start_stack
    from kvyard.stack.procs import Proc

    os.setsid()  # no terminal: the shell's Ctrl-C and hang-up are not ours
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)  # the supervisor logs to stderr

    def terminated(signum, _frame):  # `up` interrupted: start_stack stops what it started
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, terminated)
    # The autoscaler wakes the supervisor with SIGUSR1; ignored (which exec keeps) until
    # the supervisor's own handler is in place, instead of killing this process.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    state = start_stack(spec)
    cmd = supervise.command(spec.run_dir)
    state.supervisor = Proc(name="supervisor", pid=os.getpid(), log=str(log_path), cmd=cmd)
    state.save()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # The supervisor itself says "ok", once its signal handlers are in: `up` returning
    # earlier let a quick `down` kill the fresh interpreter before it could stop cleanly.
    os.set_inheritable(w, True)
    os.execv(cmd[0], [*cmd, "--ready-fd", str(w)])


def run(args: argparse.Namespace) -> int:
    from kvyard.stack.commands import redis_available
    from kvyard.stack.launch import stack_alive, stop_stack
    from kvyard.stack.spec import StackSpec
    from kvyard.stack.state import StackState

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
    if args.kv_tiers and args.kv_pool_tier == "redis" and not redis_available():
        print("kvyard up: --kv-pool-tier redis needs redis-server (apt-get install "
              "redis-server)", file=sys.stderr)
        return 1
    sim_error = _sim_counts(args)
    if sim_error:
        print(f"kvyard up: {sim_error}", file=sys.stderr)
        return 2
    if args.epp_replicas < 1:
        print("kvyard up: --epp-replicas must be >= 1", file=sys.stderr)
        return 2
    if (args.prefill > 0) != (args.decode > 0) or min(args.prefill, args.decode) < 0:
        print("kvyard up: P/D needs both --prefill N and --decode M (N, M >= 1)", file=sys.stderr)
        return 2
    if args.scale_to_zero and (args.prefill or args.decode or args.workers < 1
                               or args.idle_seconds <= 0 or args.polling_seconds <= 0):
        print("kvyard up: --scale-to-zero scales colocated workers (--workers N >= 1, not P/D) "
              "and needs --idle-seconds and --polling-seconds > 0", file=sys.stderr)
        return 2
    if args.max_workers is not None and (not args.scale_to_zero
                                         or args.max_workers < args.workers):
        print("kvyard up: --max-workers M needs --scale-to-zero and M >= --workers",
              file=sys.stderr)
        return 2
    if args.epp_config and (args.prefill or args.decode):
        print("kvyard up: --epp-config is for colocated pools (P/D runs its own config)",
              file=sys.stderr)
        return 2
    if any("=" not in kv for kv in args.scaler_metadata):
        print("kvyard up: --scaler-metadata KEY=VALUE", file=sys.stderr)
        return 2
    from kvyard.stack.models import lora_args, parse_adapters, parse_models
    try:
        model, named = parse_models(args.model)
        adapters = parse_adapters(args.adapter, named)
    except ValueError as e:
        print(f"kvyard up: {e}", file=sys.stderr)
        return 2
    if named and args.scale_to_zero:
        print("kvyard up: --scale-to-zero scales one pool; not with several --model NAME=SOURCE",
              file=sys.stderr)
        return 2
    spec = StackSpec(run_dir=rd, workers=args.workers, gateway_port=args.port, model=model,
                     named_models=named, adapters=adapters, max_loras=args.max_loras,
                     prefill=args.prefill, decode=args.decode,
                     dtype=args.dtype, standin=args.standin_workers, ready_timeout_s=args.timeout,
                     kv_tiers=args.kv_tiers, kv_pool_tier=args.kv_pool_tier,
                     kv_redis_max_memory=args.kv_redis_max_memory,
                     scale_to_zero=args.scale_to_zero, idle_seconds=args.idle_seconds,
                     polling_seconds=args.polling_seconds, prestart=args.prestart,
                     epp_replicas=args.epp_replicas, kv_events=args.kv_events,
                     scale_max=args.max_workers,
                     scaler_metadata=dict(kv.split("=", 1) for kv in args.scaler_metadata))
    if args.standin_workers:
        # Test stacks share a machine: a preferred port could be taken between the
        # free-port check and the bind, so every port is any free one.
        spec.worker_base_port = spec.admin_port = spec.scaler_port = None
        spec.epp_ports = (None, None, None)
    if args.sim:
        from kvyard.stack.sim_pool import epp_args

        spec.sim, spec.sim_profile = args.sim, args.sim_profile
        spec.sim_kv_cache_size, spec.kv_tiers = args.sim_kv_cache_size, False
        spec.sim_args = shlex.split(args.sim_args)
        spec.epp_args = epp_args(args.sim * max(1, len(named)))
    if args.epp_config:
        spec.epp_args += ["--config", str(Path(args.epp_config).resolve())]
    if adapters and not named:  # one pool: its workers get the adapters' flags directly
        spec.worker_args += lora_args(spec, "")
        spec.sim_args += lora_args(spec, "")
    what = f"{args.prefill} prefill + {args.decode} decode worker(s)" if spec.disaggregated \
        else f"{args.workers} worker(s)" + (
            f" (to zero after {args.idle_seconds:g}s idle)" if args.scale_to_zero else "")
    if args.sim:
        what = what.replace("worker(s)", f"simulated pod(s) (profile {args.sim_profile})")
    if named:
        what += f" per model ({', '.join(n for n, _ in named)})"
    epps = "the EPP" if args.epp_replicas == 1 else f"{args.epp_replicas} EPP replicas"
    print(f"kvyard: starting {what}, {epps} and Envoy (logs in {rd}/logs)", flush=True)
    error = start_supervised(spec)
    state = StackState.load(rd)
    if error is not None or state is None:
        print(f"kvyard up failed, everything stopped: {error}", file=sys.stderr)
        return 1
    for p in [*state.procs, state.supervisor]:
        ports = p.ports if len(p.ports or {}) <= 4 else f"{len(p.ports)} pods"
        print(f"  {p.name:<10} pid {p.pid:<8} {ports or ''}")
    print(f"gateway: {state.gateway_url}")
    print(f"status: {kvyard_command()} status    stop: {kvyard_command()} down")
    return 0
