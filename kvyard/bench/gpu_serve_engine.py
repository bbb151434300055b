"""The engine-alone baseline of the serving benches: the worker's own engine, no HTTP.

`engine_from_flags` builds the engine a `kvyard worker` given the same flags would run (the
worker's own argument parser and `engine_config`: weights format, KV dtype, LoRA adapters,
speculative decoding), so a mode's baseline differs from its server only by the server.
`engine_level` generates `c` fresh prompts at once (greedy, exactly `new` tokens each) after a
warm-up batch and reports output tokens/s, prefill included: what the server would reach if
serving cost nothing and requests came in lockstep.
"""
from __future__ import annotations

import argparse
import itertools
import time
from typing import Any, Callable, Sequence


def engine_from_flags(flags: Sequence[str]) -> Any:
    from kvyard.workers.engine.llm_engine import LLMEngine
    from kvyard.workers.server.cli import add_arguments, engine_config

    p = argparse.ArgumentParser(prog="kvyard worker")
    add_arguments(p)
    return LLMEngine.from_config(engine_config(p.parse_args(list(flags))))


def _spec_counts(engine: Any) -> tuple[int, int]:
    sd = engine.stats().spec_decode
    return (0, 0) if sd is None else (sd.num_draft_tokens, sd.num_accepted_tokens)


def _batch(engine: Any, ids: itertools.count, prompts: list[list[int]], names: list[str | None],
           new: int, deadline: float) -> tuple[int, bool]:
    """Run one batch to the end (or abort it at `deadline`): (tokens generated, complete)."""
    from kvyard.workers.engine.api import SamplingParams

    for p, n in zip(prompts, names):
        engine.add_request(f"b{next(ids)}", p, SamplingParams(temperature=0.0, max_tokens=new,
                                                              ignore_eos=True, lora_name=n))
    tokens = 0
    while engine.has_unfinished_requests():
        if time.monotonic() >= deadline:
            engine.abort_all()
            return tokens, False
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens, True


def engine_level(engine: Any, c: int, prompts: Callable[[], list[int]], new: int,
                 model_for: Callable[[int], str | None], deadline: float) -> dict[str, Any]:
    """{"tok_s", "truncated", and with speculation "acceptance"} for batch `c`."""
    ids = itertools.count()
    names = [model_for(i) for i in range(c)]
    _, complete = _batch(engine, ids, [prompts() for _ in range(c)], names, new, deadline)   # warm-up
    out: dict[str, Any] = {"tok_s": 0.0, "truncated": not complete}
    if not complete:
        return out
    drafts0, accepted0 = _spec_counts(engine)
    batch = [prompts() for _ in range(c)]   # fresh: no prefix-cache hits
    t0 = time.perf_counter()
    tokens, complete = _batch(engine, ids, batch, names, new, deadline)
    out.update(tok_s=tokens / (time.perf_counter() - t0), truncated=not complete)
    drafts, accepted = _spec_counts(engine)
    if drafts > drafts0:
        out["acceptance"] = (accepted - accepted0) / (drafts - drafts0)
    return out
