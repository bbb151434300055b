"""In-process decision-latency measurement, for `kvyard bench epp` and tests.

Times exactly what the ext_proc server runs per request (`Router.route`:
parse the JSON body, render the chat template, tokenize, hash blocks, filter,
score every endpoint, pick, update the prefix index) over a synthetic pool
with fresh, varied load metrics. No network and no gRPC: those are measured
end to end by the gateway benchmark.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

from .endpoints import EndpointPool, EndpointSpec
from .prompt import PromptHasher
from .router import Router
from .scheduler import build_scheduler

_HEADERS = {":method": "POST", ":path": "/v1/chat/completions"}


@dataclass(slots=True)
class _Corpus:
    """Random prose of about `tokens` tokens; `shared` of it identical per call."""

    rng: random.Random
    words: list[str]
    tokens_per_word: float

    def text(self, tokens: int) -> str:
        n = max(1, int(tokens / self.tokens_per_word))
        out = []
        for i in range(n):
            out.append(self.rng.choice(self.words))
            if i % 17 == 16:
                out.append(".\n" if i % 85 == 84 else ",")
        return " ".join(out)


def _corpus(rng: random.Random, hasher: PromptHasher) -> _Corpus:
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = ["".join(rng.choice(letters[:12 + i % 14]) for _ in range(2 + i % 7))
             for i in range(3000)]
    c = _Corpus(rng, words, 1.0)
    if hasher.tokenizer is not None:
        sample = c.text(20_000)
        c.tokens_per_word = len(hasher.tokenizer.encode(sample)) / (len(sample.split(" ")))
    else:
        c.tokens_per_word = sum(len(w) + 1 for w in words) / len(words) / 4
    return c


def build_router(num_endpoints: int, model: str = "demo", seed: int = 0) -> Router:
    """A router over `num_endpoints` synthetic endpoints with fresh metrics."""
    rng = random.Random(seed)
    pool = EndpointPool()
    pool.set_source("bench", [EndpointSpec(f"10.0.{i // 250}.{i % 250 + 1}:8000")
                              for i in range(num_endpoints)])
    now = time.monotonic()
    for e in pool.all():
        e.waiting, e.running, e.kv_usage = rng.randint(0, 8), rng.randint(0, 32), rng.random() * .9
        e.last_ok = now + 3600  # stays fresh for the whole run
    sched = build_scheduler(seed=seed)
    hasher = PromptHasher(block_size=sched.block_size)
    if model.lower() != "none":
        from kvyard.common.tokenizer import ChatTemplateError, load_tokenizer
        hasher.set_tokenizer(load_tokenizer(model), ChatTemplateError)
    return Router(pool, sched, hasher, [])


def decision_latency(num_endpoints: int, prompt_tokens: int, iterations: int, *,
                     model: str = "demo", shared_fraction: float = 0.0, seed: int = 0,
                     warmup: int = 3) -> list[float]:
    """Seconds per decision, one per iteration.

    `shared_fraction` of each prompt is a system prompt common to all
    iterations (the rest is new text every time); 0.0 is the worst case for
    the tokenizer cache, ~0.9 is typical of agents and chat with history.
    """
    rng = random.Random(seed)
    router = build_router(num_endpoints, model, seed)
    corpus = _corpus(rng, router.hasher)
    shared_tokens = int(prompt_tokens * shared_fraction)
    system = corpus.text(shared_tokens) if shared_tokens else ""
    bodies = []
    for _ in range(iterations + warmup):
        msgs = [{"role": "user", "content": corpus.text(prompt_tokens - shared_tokens)}]
        if system:
            msgs.insert(0, {"role": "system", "content": system})
        bodies.append(json.dumps({"model": "m", "messages": msgs, "max_tokens": 16}).encode())
    out = []
    perf = time.perf_counter
    for i, body in enumerate(bodies):
        t0 = perf()
        router.route(_HEADERS, body)
        dt = perf() - t0
        if i >= warmup:
            out.append(dt)
    return out


def prompt_tokens_of(router: Router, body: bytes) -> int:
    """Token count of a body's prompt, to check the synthetic sizes."""
    from .request import parse_request
    return router.hasher.hashes(parse_request(body, "/v1/chat/completions", {}, None))[1]
