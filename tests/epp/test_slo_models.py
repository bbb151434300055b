"""The latency models' structure: relative-error fit, pooled per role with an endpoint's
own model taking over where it predicts that endpoint better, the predictor's trace and
its offline replay (`kvyard.bench.slo_fit`), which never learns an outcome early."""
from __future__ import annotations

import json
import random

from kvyard.bench.slo_fit import compare, replay, shipped_ttft
from kvyard.epp.slo.models import PoolModels
from kvyard.epp.slo.online import LatencyModel
from tests.epp.test_slo import HEADERS, SLO, _app, _body, _teach


def test_relative_fit_beats_the_mean_on_relative_error():
    """Waits whose spread grows with the load (as queues do): the absolute fit chases the
    long waits, the relative one keeps the short ones' percentage error down."""
    rng = random.Random(4)
    rel, ab = LatencyModel(2), LatencyModel(2, relative=False)
    err = {True: 0.0, False: 0.0}
    for i in range(4000):
        q = rng.uniform(0, 10)
        x = [1.0, q]
        y = (0.05 + 0.1 * q) * rng.lognormvariate(0, 0.2 + 0.1 * q)
        for m in (rel, ab):
            if i >= 2000:
                err[m.relative] += abs(m.predict(x)[0] - y) / y
            m.update(x, y)
    assert err[True] < 0.8 * err[False]


def test_pooled_model_serves_alike_endpoints_and_a_different_one_gets_its_own():
    rng = random.Random(5)
    pm = PoolModels(2, min_samples=20)

    def serve(n: int, pods: list[str]) -> None:
        for _ in range(n):
            a = rng.choice(pods)
            q = rng.uniform(0, 4)
            y = (0.1 + 0.05 * q) * (5.0 if a == "slow" else 1.0) * rng.uniform(0.9, 1.1)
            pm.learn(a, "both", [1.0, q], y)

    serve(2000, ["a", "b", "c"])
    assert pm.model("a", "both") is pm.pooled["both"]  # alike pods: the pooled model
    serve(800, ["a", "b", "c", "slow"])
    slow = pm.model("slow", "both")
    assert slow is pm.own["slow"].model
    assert abs(slow.predict([1.0, 2.0])[0] - 1.0) < 0.15
    assert pm.model("new-pod", "both") is pm.pooled["both"]
    pm.forget_endpoint("slow")
    assert pm.model("slow", "both") is pm.pooled["both"]


def test_trace_records_each_followed_request_and_replay_learns_only_past_outcomes(tmp_path):
    trace = tmp_path / "trace.jsonl"
    app = _app(tmp_path, [{"type": "latency", "weight": 4, "minSamples": 5,
                           "traceFile": str(trace)}], n=2, flow_control=False)
    _teach(app, 40)
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) == 40
    assert all(abs(r["ttft"] - 0.1) < 1e-9 and abs(r["tpot"] - 0.02) < 1e-9 and r["out"] == 10
               for r in rows)
    assert rows[-1]["pred"][0] > 0 and "ptp" in rows[0] and "l_prefilling" in rows[0]
    # outcomes that all arrive after the last routing: nothing may be learned before
    late = [{**r, "t0": float(i), "ttft": 1000.0} for i, r in enumerate(rows)]
    preds = replay(late, "ttft", shipped_ttft)
    assert all(p[0] == preds[0][0] for p in preds)  # an untrained model, every time
    on_time = [{**r, "t0": float(i), "ttft": 0.1} for i, r in enumerate(rows)]
    learned = replay(on_time, "ttft", shipped_ttft)
    assert abs(learned[-1][0] - 0.1) < 0.02
    out = compare([str(trace)])
    assert {r["kind"] for r in out} == {"ttft", "tpot"}
    assert all(r["samples"][0] == 20 for r in out if r["kind"] == "ttft")


def _teach_all(app, ttft: float, tpot: float, n: int) -> None:
    from kvyard.epp.prompt import LazyPrompt
    from kvyard.epp.scheduling.types import SchedRequest
    from kvyard.epp.slo.headers import FACTS, RequestFacts, Slo
    import time

    pred = app.predictor
    for e in app.pool.all():
        for _ in range(n):  # standard requests (priority 0) with the interactive objective
            req = SchedRequest("m", LazyPrompt.of_hashes([1, 2]), now=time.monotonic())
            req.cycle.write(FACTS, RequestFacts(Slo(0.5, 0.05), 128, 64, "", "m"))
            f = pred.start(req, e)
            pred.claim(req.prompt)
            pred.first_token(f, f.t0 + ttft)
            pred.finish(f, f.t0 + ttft + 9 * tpot, 10, 10)
        e.pending = 0


def test_sheddable_requests_yield_when_the_standard_objective_is_out_of_reach(tmp_path):
    """Every endpoint answers in 0.8 s: a batch request (TTFT <= 1 s) could still be met,
    but the interactive objective (0.5 s) no longer is: with protectStandard (the
    default) SLO admission sheds the batch request; without it, it is routed."""
    batch = {**HEADERS, "x-llm-d-slo-ttft-ms": "1000", "x-llm-d-slo-tpot-ms": "100",
             "x-llm-d-inference-objective": "-1"}
    for protect, shed in ((True, True), (False, False)):
        app = _app(tmp_path, [{"type": "latency", "weight": 4, "minSamples": 5,
                               "admission": True, "protectStandard": protect}],
                   n=2, name=f"p{protect}.yaml", flow_control=False)
        _teach_all(app, 0.8, 0.02, 40)
        assert app.predictor.standard.objective().ttft_s == 0.5
        out = app.director.handle(batch, _body("batch question"))
        assert (getattr(out, "status", None) == 429) is shed, protect
        kept = app.director.handle({**HEADERS, **SLO}, _body("interactive"))
        assert type(kept).__name__ == "Decision"  # standard: never shed, goes least late
    fast = _app(tmp_path, [{"type": "latency", "weight": 4, "minSamples": 5,
                            "admission": True}], n=2, name="fast.yaml", flow_control=False)
    _teach_all(fast, 0.1, 0.02, 40)  # both objectives in reach: nothing is shed
    assert type(fast.director.handle(batch, _body("batch"))).__name__ == "Decision"


def test_standard_class_is_judged_by_the_pools_queues_not_the_requests_own_prompt():
    from kvyard.epp.pool.endpoints import Endpoint
    from kvyard.epp.slo.features import EndpointLoad, ttft_features
    from kvyard.epp.slo.headers import Slo
    from kvyard.epp.slo.predictor import LatencyPredictor, Prediction

    class Req:
        now = 0.0

    rng = random.Random(6)
    pred = LatencyPredictor()
    ep = Endpoint("10.0.0.1:8000")
    for _ in range(500):  # TTFT = 50 ms + 0.25 ms per token queued or own
        unc, queued = rng.uniform(0, 4000), rng.uniform(0, 4000)
        x = ttft_features(ep, EndpointLoad(prefill_tokens=queued), unc, 0.0)
        pred.ttft_models.learn(ep.address, ep.role, x, 0.05 + 0.00025 * (unc + queued))
    for _ in range(50):
        pred.standard.add(Slo(0.5, 0.05), 200.0)
    own_prompt_late = [Prediction(1.1, 1.2, 0.02, 0.03)]  # a cold 4,000-token batch prompt
    assert not pred.standard_late(Req(), [ep], own_prompt_late)
    pred.load(ep.address).prefill_tokens = 3000.0  # queues: a typical request waits 0.85 s
    assert pred.standard_late(Req(), [ep], own_prompt_late)
