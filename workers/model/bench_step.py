"""Time one decode step of the demo model: `python -m kvyard.workers.model.bench_step`.

Measures the model + attention alone (no scheduler), per dtype and batch size,
with every sequence holding `--ctx` cached tokens. Reports the median of the
timed steps, which is robust to the noise of a shared machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvyard.common.models import resolve_model

from ..attention.reference import SeqStep, build_metadata
from . import kv_cache_shape, load_model


def decode_step_ms(model, cfg, batch: int, ctx: int, steps: int, block_size: int = 16) -> float:
    per_seq = -(-(ctx + steps + 1) // block_size)
    caches = [torch.zeros(kv_cache_shape(cfg, batch * per_seq, block_size), dtype=model.dtype)
              for _ in range(cfg.num_layers)]
    # Interleave blocks across sequences, as a busy block pool would.
    blocks = [[j * batch + i for j in range(per_seq)] for i in range(batch)]
    ids = torch.randint(0, cfg.vocab_size, (batch,))
    times = []
    with torch.inference_mode():
        for s in range(steps + 2):
            n = ctx + s
            meta = build_metadata([SeqStep(b, n, 1) for b in blocks], block_size, batch)
            t0 = time.perf_counter()
            h = model(ids, torch.full((batch,), n), caches, meta)
            ids = model.compute_logits(h).argmax(-1)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    for dt in a.dtype:
        t0 = time.perf_counter()
        model, cfg = load_model(resolve_model(a.model), getattr(torch, dt))
        print(f"{dt}: loaded in {time.perf_counter() - t0:.2f}s ({torch.get_num_threads()} threads)")
        for b in a.batch:
            ms = decode_step_ms(model, cfg, b, a.ctx, a.steps)
            print(f"  batch {b:3d} ctx {a.ctx}: {ms:7.2f} ms/step  {b * 1e3 / ms:8.1f} tok/s")


if __name__ == "__main__":
    main()
