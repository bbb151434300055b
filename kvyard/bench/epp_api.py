"""In-process decision-latency measurement of the EPP, for `kvyard bench epp` and tests.

Times exactly what the ext_proc server runs per request: `Director.handle` of
a director wired by `EppApp`, as `kvyard epp` wires it (parse the JSON body,
render the chat template, tokenize, hash blocks, admission, filter, score
every endpoint, pick, pre-request hooks, metrics), over a synthetic pool with
fresh, varied load metrics. No network and no gRPC: those are measured end to
end by the gateway benchmark.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

from kvyard.epp.app import EppApp, EppConfig
from kvyard.epp.director import Director
from kvyard.epp.pool.endpoints import EndpointSpec
from kvyard.epp.prompt import PromptHasher
from kvyard.epp.request import parse_request
from kvyard.epp.saturation import pod_saturation
from kvyard.epp.scheduling.types import Decision

_HEADERS = {":method": "POST", ":path": "/v1/chat/completions"}


_DOC_MODULES = ("os", "re", "json", "asyncio", "collections", "argparse", "logging",
                "subprocess", "email", "http.client", "unittest", "inspect", "pathlib",
                "functools", "itertools", "random", "statistics", "decimal", "socket", "tarfile")


def _paragraphs() -> list[str]:
    """Natural English (and some code) from the standard library's docstrings:
    realistic word statistics for the tokenizer, available offline."""
    import importlib

    paras: list[str] = []
    for name in _DOC_MODULES:
        mod = importlib.import_module(name)
        for attr in dir(mod):
            doc = getattr(getattr(mod, attr, None), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200:
                paras.append(doc.strip())
    return sorted(set(paras))


@dataclass(slots=True)
class _Corpus:
    """Random sequences of real paragraphs, about `tokens` tokens long."""

    rng: random.Random
    paras: list[str]
    chars_per_token: float

    def text(self, tokens: int) -> str:
        want = int(tokens * self.chars_per_token)
        out, n = [f"Request {self.rng.getrandbits(64):x}."], 0
        while n < want:
            p = self.rng.choice(self.paras)
            out.append(p)
            n += len(p) + 2
        return "\n\n".join(out)[:want]


def _corpus(rng: random.Random, hasher: PromptHasher) -> _Corpus:
    c = _Corpus(rng, _paragraphs(), 4.0)
    if hasher.tokenizer is not None:
        sample = c.text(50_000)
        c.chars_per_token = len(sample) / len(hasher.tokenizer.encode(sample))
    return c


def build_director(num_endpoints: int, model: str = "demo", seed: int = 0,
                   flow_control: bool = True, config: str | None = None) -> Director:
    """The director `kvyard epp` runs (default config; `flow_control=False`: as with
    `--no-flow-control`), over `num_endpoints` synthetic endpoints with fresh metrics."""
    rng = random.Random(seed)
    # model "none": no served-model check (bodies name any model); the tokenizer is set below.
    app = EppApp(EppConfig(model="none", seed=seed, flow_control=flow_control, config=config))
    pool = app.pool
    pool.set_source("bench", [EndpointSpec(f"10.0.{i // 250}.{i % 250 + 1}:8000")
                              for i in range(num_endpoints)])
    now = time.monotonic()
    for e in pool.all():
        e.waiting, e.running, e.kv_usage = rng.randint(0, 8), rng.randint(0, 32), rng.random() * .9
        e.last_ok = now + 3600  # stays fresh for the whole run
    if pool.all() and all(pod_saturation(e, picks=False) >= 1.0 for e in pool.all()):
        first = pool.all()[0]  # room on one endpoint at least: a saturated pool holds requests
        first.waiting, first.kv_usage = 0, 0.5
    if model.lower() != "none":
        from kvyard.common.tokenizer import ChatTemplateError, load_tokenizer
        app.director.hasher.set_tokenizer(load_tokenizer(model), ChatTemplateError)
    return app.director


def latencies(num_endpoints: int, prompt_tokens: int, iterations: int, *,
              model: str = "demo", shared_fraction: float = 0.0, seed: int = 0,
              warmup: int = 3, clock: str = "wall",
              flow_control: bool = True) -> tuple[list[float], list[float]]:
    """(decision seconds, deferred index-teaching seconds), one pair per iteration.

    The decision is what Envoy waits for; the deferred part (hashing the rest
    of the prompt) runs after the answer, in a worker thread in the server,
    and is timed here separately so that neither cost hides.
    `shared_fraction` of each prompt is a system prompt common to all
    iterations (the rest is new text every time); 0.0 is the worst case for
    the tokenizer cache, ~0.9 is typical of agents and chat with history.
    `clock="cpu"` times this thread's CPU (time.thread_time): on a shared,
    oversubscribed machine wall time mostly measures the neighbours.
    """
    rng = random.Random(seed)
    director = build_director(num_endpoints, model, seed, flow_control)
    corpus = _corpus(rng, director.hasher)
    shared_tokens = int(prompt_tokens * shared_fraction)
    system = corpus.text(shared_tokens) if shared_tokens else ""
    bodies = []
    for _ in range(iterations + warmup):
        msgs = [{"role": "user", "content": corpus.text(prompt_tokens - shared_tokens)}]
        if system:
            msgs.insert(0, {"role": "system", "content": system})
        bodies.append(json.dumps({"model": "m", "messages": msgs, "max_tokens": 16}).encode())
    decide, deferred = [], []
    perf = time.thread_time if clock == "cpu" else time.perf_counter
    for i, body in enumerate(bodies):
        t0 = perf()
        d = director.handle(_HEADERS, body)
        t1 = perf()
        if type(d) is not Decision:  # a synthetic pool never holds or refuses
            raise RuntimeError(f"the bench's request was not routed: {d!r}")
        if d.prompt is not None:  # what the server's Finisher does after the answer
            director.scheduler.learn(d.endpoint.address, d.prompt.finish())
        t2 = perf()
        if i >= warmup:
            decide.append(t1 - t0)
            deferred.append(t2 - t1)
    return decide, deferred


def decision_latency(num_endpoints: int, prompt_tokens: int, iterations: int, *,
                     model: str = "demo", shared_fraction: float = 0.0, seed: int = 0,
                     warmup: int = 3, clock: str = "wall",
                     flow_control: bool = True) -> list[float]:
    """Seconds per routing decision (what Envoy waits for), one per iteration."""
    return latencies(num_endpoints, prompt_tokens, iterations, model=model,
                     shared_fraction=shared_fraction, seed=seed, warmup=warmup, clock=clock,
                     flow_control=flow_control)[0]


def prompt_tokens_of(director: Director, body: bytes) -> int:
    """Token count of a body's prompt, to check the synthetic sizes."""
    return director.hasher.hashes(parse_request(body, "/v1/chat/completions", {}, None))[1]
