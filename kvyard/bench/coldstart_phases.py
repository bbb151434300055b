"""`python -m kvyard.bench.coldstart_phases WORKER-FLAGS`: where a worker's start goes.

Runs the steps `kvyard worker` runs before it listens (workers/server/cli.py:
imports, the CPU kernels, the connector, the engine: weights, tokenizer, KV cache),
in a fresh process as the worker does, then a first and a second engine step of the
same prompt (the first pays the lazy initialisations: the warm-up). Prints one JSON
line of wall times; `start` is this interpreter's first line, so the parent's spawn
time gives the interpreter's own start-up.
"""
from __future__ import annotations

import time

T = {"start": time.time()}

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402


def main(argv: list[str]) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as kvyard.cli.main sets it
    import torch  # noqa: F401

    T["torch"] = time.time()
    from kvyard.cli import build_parser

    args = build_parser(["worker", *argv]).parse_args(["worker", *argv])
    from kvyard.workers.engine.async_engine import AsyncLLMEngine
    from kvyard.workers.server import cli as wcli

    T["imports"] = time.time()
    from kvyard.workers import cpu_ops

    cpu_ops.load()
    T["kernels"] = time.time()
    config = wcli.engine_config(args)
    kv = wcli._kvconnector()
    if kv is not None:
        config.kv_connector = kv.build_connector(args, config)
    T["connector"] = time.time()
    spans: dict[str, float] = {}
    import kvyard.common.tokenizer as tok_mod
    import kvyard.workers.model as model_mod

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.time()
            try:
                return fn(*a, **kw)
            finally:
                spans[name] = spans.get(name, 0.0) + time.time() - t0
        return wrapper

    model_mod.load_model = timed("weights", model_mod.load_model)
    tok_mod.load_tokenizer = timed("tokenizer", tok_mod.load_tokenizer)
    engine = AsyncLLMEngine(config)
    T["engine"] = time.time()
    steps = _first_steps(engine)
    return {"t": T, "spans": spans, "steps": steps}


def _first_steps(engine) -> list[float]:
    """Seconds to the first token of the same short prompt, twice, on the engine's loop."""
    import asyncio

    from kvyard.workers.engine.api import SamplingParams

    async def once(i: int) -> float:
        t0 = time.perf_counter()
        async for _ in engine.generate(f"bench-{i}", [1, 2, 3, 4, 5, 6, 7, 8],
                                       SamplingParams(max_tokens=1, temperature=0.0)):
            break
        return time.perf_counter() - t0

    async def go() -> list[float]:
        await engine.start()
        try:
            return [await once(0), await once(1)]
        finally:
            await engine.shutdown()

    return asyncio.run(go())


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
