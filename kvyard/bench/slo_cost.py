"""What SLO routing costs the EPP, paired: the same requests (with SLO headers) decided
by `Director.handle` (what `kvyard bench epp` times) of an EPP with the default-shaped
config and of one with the latency scorer added (its predictor trained, so every
request is predicted on every endpoint), and sheddable requests through SLO admission
(which also predicts a typical standard request on every endpoint), alternating request
by request; plus the
cost of timing one streamed response chunk (`ResponseTracker.body`). CPU time of
this thread (`time.thread_time`): on a shared machine wall time measures neighbours.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from kvyard.bench.report import percentile

SLO = {":method": "POST", ":path": "/v1/completions", "x-llm-d-slo-ttft-ms": "500",
       "x-llm-d-slo-tpot-ms": "50"}
BASE = [{"type": "prefix-cache", "weight": 3}, {"type": "queue", "weight": 2},
        {"type": "kv-cache-utilization", "weight": 2}]
SHEDDABLE = {**SLO, "x-llm-d-slo-ttft-ms": "1000", "x-llm-d-slo-tpot-ms": "100",
             "x-llm-d-inference-objective": "-1"}


def _app(scorers: list[dict], n: int, tmp: Path, name: str):
    from kvyard.epp.app import EppApp, EppConfig
    from kvyard.epp.pool.endpoints import EndpointSpec

    conf = {"profileHandler": {"type": "single-profile"},
            "profiles": {"default": {"filters": ["healthy"], "scorers": scorers,
                                     "picker": {"type": "max-score", "maxEndpoints": 1}}}}
    (tmp / name).write_text(json.dumps(conf))
    app = EppApp(EppConfig(model="none", seed=0, flow_control=False, config=str(tmp / name)))
    app.pool.set_source("b", [EndpointSpec(f"10.0.{i // 250}.{i % 250 + 1}:8000")
                              for i in range(n)])
    for i, e in enumerate(app.pool.all()):
        e.last_ok, e.waiting, e.running, e.kv_usage = time.monotonic() + 3600, i % 3, i % 7, 0.3
    return app


def _body(i: int) -> bytes:
    return json.dumps({"model": "m", "prompt": f"system prompt {i % 10} " * 200 + str(i),
                       "max_tokens": 64, "stream": True}).encode()


def _train(app, n: int = 64) -> None:
    from kvyard.epp.slo.observe import ResponseTracker

    chunk = b'data: {"choices":[{"text":" a"}]}\n\n'
    for i in range(n):
        d = app.director.handle(SLO, _body(10_000 + i))
        f = app.predictor.claim(d.prompt)
        tr = ResponseTracker(app.predictor, f)
        tr.headers({":status": "200", "content-type": "text/event-stream"})
        for k in range(8):
            tr.body(chunk, k == 7, f.t0 + 0.1 + 0.02 * k + 0.001 * (i % 5))


def paired(endpoints: int, iterations: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base = _app(BASE, endpoints, tmp, "base.json")
        lat = _app([*BASE, {"type": "latency", "weight": 4, "minSamples": 8}], endpoints, tmp,
                   "lat.json")
        adm = _app([*BASE, {"type": "latency", "weight": 4, "minSamples": 8,
                            "admission": True}], endpoints, tmp, "adm.json")
        _train(lat)
        _train(adm)
        arms = [("base", base, SLO), ("latency", lat, SLO), ("admission", adm, SHEDDABLE)]
        out: dict[str, list[float]] = {name: [] for name, _, _ in arms}
        for i in range(iterations):
            body = _body(i)
            for name, app, headers in arms[i % 3:] + arms[:i % 3]:
                for e in app.pool.all():  # as a scrape would: the picks are in its queue
                    e.pending = 0
                t0 = time.thread_time()
                dec = app.director.handle(headers, body)
                out[name].append(time.thread_time() - t0)
                if getattr(dec, "endpoint", None) is None:  # shed: nothing routed
                    continue
                app.director.scheduler.learn(dec.endpoint.address, dec.prompt.finish())
                if app.predictor is not None:
                    f = app.predictor.claim(dec.prompt)
                    if f is not None:
                        app.predictor.abandon(f)
        return {"endpoints": endpoints, **{f"{k}_p{q}": percentile(v, q) for k, v in out.items()
                                           for q in (50, 99)}}


def chunk_cost(n: int = 20000) -> float:
    """CPU seconds to time one streamed chunk of an observed response."""
    from kvyard.epp.slo.headers import RequestFacts
    from kvyard.epp.slo.observe import ResponseTracker
    from kvyard.epp.slo.features import TPOT_DIM, TTFT_DIM
    from kvyard.epp.slo.predictor import Flight, LatencyPredictor, Prediction

    p = LatencyPredictor()
    f = Flight("a", "both", RequestFacts(None, 100, 64, "", "m"), 0.0, [1.0] * TTFT_DIM,
               [1.0] * TPOT_DIM,
               Prediction(0.1, 0.1, 0.02, 0.02), 0, 0.0)
    tr = ResponseTracker(p, f)
    tr.headers({":status": "200", "content-type": "text/event-stream"})
    chunk = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,' \
            b'"text":" word","logprobs":null,"finish_reason":null}]}\n\n'
    t0 = time.thread_time()
    for _ in range(n):
        tr.body(chunk, False, 1.0)
    return (time.thread_time() - t0) / n


def epp_cost(endpoints: list[int], iterations: int) -> dict:
    return {"decision": [paired(n, iterations) for n in endpoints],
            "chunk_cpu_s": chunk_cost()}
