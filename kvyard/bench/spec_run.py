"""One measurement of `kvyard bench spec` / `gpu_spec`: a workload's prompts through an
in-process engine at a concurrency, greedy, timed per output token.

The engine is driven directly (no HTTP): the comparison is speculation against none on
the same engine, and a server's overhead would be the same on both sides. Concurrency c
means c requests in the engine at once: each finished request is replaced by the next
prompt until all have run.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

WORKLOADS = ("code", "repetitive", "qa", "creative")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def mode_configs(draft_layers: int, draft_k: int = 3) -> dict[str, dict | None]:
    """Each mode's --speculative-config (None: no speculation)."""
    draft = {"method": "draft_model", "model": "demo", "draft_layers": draft_layers,
             "num_speculative_tokens": draft_k}
    return {"none": None,
            "ngram": {**NGRAM, "policy": "always"}, "ngram-auto": {**NGRAM, "policy": "auto"},
            "draft": {**draft, "policy": "always"}, "draft-auto": {**draft, "policy": "auto"}}


def load_prompts(tokenizer: Any, workload: str) -> list[list[int]]:
    """The shipped prompts of a workload (kvyard/bench/data/spec/<workload>.jsonl), chat-encoded."""
    text = resources.files("kvyard.bench").joinpath("data", "spec", f"{workload}.jsonl").read_text()
    return [tokenizer.encode_chat(json.loads(line)["messages"]) for line in text.splitlines() if line.strip()]


@dataclass(slots=True)
class Measurement:
    output_tokens: int
    wall_s: float
    tpot_ms: float                 # mean over requests of (last - first token) / (tokens - 1)
    tokens: list[list[int]]        # each prompt's output, in prompt order
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def acceptance(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0


def measure(engine: Any, prompts: list[list[int]], concurrency: int, max_tokens: int) -> Measurement:
    from kvyard.workers.engine.api import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    spec = engine.speculator
    before = spec.stats.snapshot() if spec is not None else None
    outs: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    queue = list(enumerate(prompts))
    live = 0
    t0 = time.perf_counter()
    while queue or live:
        while queue and live < concurrency:
            i, p = queue.pop(0)
            engine.add_request(f"r{i}", p, params)
            outs[f"r{i}"] = []
            live += 1
        for o in engine.step():
            now = time.perf_counter()
            if o.new_token_ids:
                outs[o.request_id] += o.new_token_ids
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
            if o.finished:
                live -= 1
    wall = time.perf_counter() - t0
    tpots = [(last[r] - first[r]) / (len(t) - 1) for r, t in outs.items() if len(t) > 1]
    m = Measurement(sum(len(t) for t in outs.values()), wall,
                    1000 * statistics.mean(tpots) if tpots else float("nan"),
                    [outs[f"r{i}"] for i in range(len(prompts))])
    if spec is not None:
        after = spec.stats
        m.drafts = after.num_drafts - before.num_drafts
        m.draft_tokens = after.num_draft_tokens - before.num_draft_tokens
        m.accepted = after.num_accepted_tokens - before.num_accepted_tokens
        old = before.accepted_per_pos + [0] * (len(after.accepted_per_pos) - len(before.accepted_per_pos))
        m.accepted_per_pos = [a - b for a, b in zip(after.accepted_per_pos, old)]
    return m


def make_engine(loaded: tuple[Any, Any, Any], spec: dict | None, dtype: str = "float32",
                device: str = "cpu", **kw: Any) -> Any:
    """An engine over already loaded weights (the draft, a truncated view, shares them)."""
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm_engine import LLMEngine

    model, cfg, tok = loaded
    conf = EngineConfig(model="demo", dtype=dtype, device=device, enable_prefix_caching=False,
                        speculative_config=spec, **kw)
    return LLMEngine(conf, model, cfg, tok)


def paired(engines: dict[str, Any], modes: list[str], prompts: list[list[int]], c: int,
           max_tokens: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Every mode on the same prompts, round after round in alternating order; per mode the
    median round's tok/s and TPOT, the median over rounds of tok/s over the same round's
    no-speculation tok/s, acceptance (share of draft tokens accepted), mean accepted length
    (tokens per drafted step), acceptance per position, and whether every round's greedy
    tokens equal no speculation's."""
    runs: dict[str, list[Measurement]] = {m: [] for m in modes}
    for r in range(rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            runs[m].append(measure(engines[m], prompts, c, max_tokens))
    base = runs["none"]
    out: dict[str, dict[str, Any]] = {}
    for m, ms in runs.items():
        drafts = sum(x.drafts for x in ms)
        draft_tokens = sum(x.draft_tokens for x in ms)
        accepted = sum(x.accepted for x in ms)
        per_pos = [sum(col) for col in zip(*[x.accepted_per_pos for x in ms if x.accepted_per_pos])]
        mid = sorted(ms, key=lambda x: x.tok_s)[(len(ms) - 1) // 2]
        out[m] = {"tok_s": round(mid.tok_s, 1), "tpot_ms": round(mid.tpot_ms, 2),
                  "speedup": round(statistics.median(x.tok_s / b.tok_s for x, b in zip(ms, base)), 3),
                  "acceptance": round(accepted / draft_tokens, 3) if draft_tokens else None,
                  "mean_len": round(1 + accepted / drafts, 2) if drafts else None,
                  "per_pos": [round(n / drafts, 3) for n in per_pos] if drafts else None,
                  "same_tokens": all(x.tokens == b.tokens for x, b in zip(ms, base))}
    return out


def batch_prompts(prompts: list[list[int]], c: int, n_c1: int) -> list[list[int]]:
    """What a workload runs at concurrency c: its first n_c1 prompts one by one at 1, else
    at least c prompts (repeated as needed; no prefix caching in the bench)."""
    if c == 1:
        return prompts[:n_c1]
    return (prompts * -(-c // len(prompts)))[:max(c, len(prompts))]
