"""SLO-aware routing: the online models, output-length prediction, the SLO headers, the
latency scorer (requests without SLO headers route exactly as without it), SLO
admission, the metrics and the predictive scaler term."""
from __future__ import annotations

import json
import math
import random
import time

from kvyard.common.wire import DROPPED_REASON_HEADER
from kvyard.epp.app import EppApp, EppConfig
from kvyard.epp.pool.endpoints import EndpointSpec
from kvyard.epp.request import Rejection, priority_of
from kvyard.epp.scaler.meta import ScaledObjectParams
from kvyard.epp.scheduling.types import Decision
from kvyard.epp.slo.admission import SloAdmission
from kvyard.epp.slo.observe import ResponseTracker
from kvyard.epp.slo.online import LatencyModel, Quantile, Rls
from kvyard.epp.slo.outlen import OutputLength

HEADERS = {":method": "POST", ":path": "/v1/completions"}
SLO = {"x-llm-d-slo-ttft-ms": "500", "x-llm-d-slo-tpot-ms": "50"}
PRECISE_LOAD = [{"type": "prefix-cache", "weight": 3}, {"type": "queue", "weight": 2},
                {"type": "kv-cache-utilization", "weight": 2}]


def _body(prompt: str, max_tokens: int = 64) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                       "stream": True}).encode()


def _app(tmp_path, scorers: list[dict], n: int = 4, name: str = "s.yaml", **cfg) -> EppApp:
    conf = {"profileHandler": {"type": "single-profile"},
            "profiles": {"default": {"filters": ["healthy"], "scorers": scorers,
                                     "picker": {"type": "max-score", "maxEndpoints": 1}}}}
    path = tmp_path / name
    path.write_text(json.dumps(conf))
    app = EppApp(EppConfig(model="none", seed=7, config=str(path), **cfg))
    app.pool.set_source("t", [EndpointSpec(f"10.0.0.{i}:8000") for i in range(1, n + 1)])
    for e in app.pool.all():
        e.last_ok = time.monotonic()
    return app


def test_rls_learns_a_linear_law_and_the_quantile_covers_90_percent():
    rng = random.Random(1)
    m = LatencyModel(3)
    ape, covered, n = 0.0, 0, 0
    for i in range(3000):
        x = [1.0, rng.uniform(0, 4), rng.uniform(0, 10)]
        y = (0.05 + 0.1 * x[1] + 0.02 * x[2]) * rng.uniform(0.9, 1.1)
        if i >= 1000:  # held out: predicted before it is learned
            mean, p90 = m.predict(x)
            ape += abs(mean - y) / y
            covered += y <= p90
            n += 1
        m.update(x, y)
    assert ape / n < 0.06
    assert 0.85 <= covered / n <= 0.95
    r = Rls(2)
    for _ in range(200):
        r.update([1.0, 2.0], 5.0)
    assert abs(r.predict([1.0, 2.0]) - 5.0) < 1e-3
    q = Quantile(0.9, 0.01)  # on the log-ratio scale it is used on (about +-1)
    for _ in range(5000):
        q.update(rng.uniform(-1.0, 1.0))
    assert 0.7 < q.value < 0.9


def test_output_length_learns_each_tenant_and_beats_max_tokens():
    ol = OutputLength()
    rng = random.Random(2)
    typical = {f"t{i}": rng.randint(10, 200) for i in range(10)}
    for _ in range(400):
        t = rng.choice(list(typical))
        actual = max(1, int(rng.gauss(typical[t], 5)))
        ol.observe("m", t, 512, ol.predict("m", t, 512), actual)
    e = ol.errors()
    assert e["mae"] < 0.2 * e["mae_baseline"]
    assert ol.predict("m", "new-tenant", 512) < 512  # the model's history, not the cap
    assert ol.predict("other-model", "", None) == ol.default_tokens
    assert ol.predict("m", "t0", 4) == 4  # never above max_tokens


def test_objective_header_and_its_alias():
    assert priority_of({"x-llm-d-inference-objective": "-1"}, {}) == -1
    assert priority_of({"x-gateway-inference-objective": "-2"}, {}) == -2
    assert priority_of({"x-llm-d-inference-objective": "batch"}, {"batch": -5}) == -5
    assert priority_of({}, {}) == 0


def test_bad_slo_header_is_a_400_naming_it(tmp_path):
    app = _app(tmp_path, [*PRECISE_LOAD, {"type": "latency", "weight": 4}], flow_control=False)
    out = app.director.handle({**HEADERS, "x-llm-d-slo-ttft-ms": "soon"}, _body("hi"))
    assert isinstance(out, Rejection) and out.status == 400
    assert json.loads(out.body())["error"]["param"] == "x-llm-d-slo-ttft-ms"
    ok = app.director.handle({**HEADERS, **SLO}, _body("hi"))
    assert type(ok) is Decision


def test_requests_without_slo_headers_route_exactly_as_without_the_scorer(tmp_path):
    base = _app(tmp_path, PRECISE_LOAD, name="a.yaml", flow_control=False)
    lat = _app(tmp_path, [*PRECISE_LOAD, {"type": "latency", "weight": 4, "minSamples": 1}],
               name="b.yaml", flow_control=False)
    _teach(lat, 50)  # a confident predictor, which must still change nothing
    rng = random.Random(3)
    for i in range(200):
        load = [(rng.randint(0, 6), rng.randint(0, 8), rng.random()) for _ in range(4)]
        for app in (base, lat):
            for e, (w, r, kv) in zip(sorted(app.pool.all(), key=lambda e: e.address), load):
                e.waiting, e.running, e.kv_usage, e.pending = w, r, kv, 0
        prompt = f"tenant {i % 7} " * 40 + f"question {i}"
        a = base.director.handle(HEADERS, _body(prompt))
        b = lat.director.handle(HEADERS, _body(prompt))
        assert a.endpoint.address == b.endpoint.address, i
        base.director.finisher.submit(a)


def _teach(app: EppApp, n: int, slow: str | None = None) -> None:
    """Route n SLO requests and report outcomes through the real tracker: every endpoint
    answers in 0.1 s TTFT / 20 ms TPOT, `slow` in 2 s / 200 ms."""
    pred = app.predictor
    for i in range(n):
        d = app.director.handle({**HEADERS, **SLO}, _body(f"warm {i}"))
        assert type(d) is Decision
        f = pred.claim(d.prompt)
        assert f is not None
        ttft, tpot = (2.0, 0.2) if d.endpoint.address == slow else (0.1, 0.02)
        tr = ResponseTracker(pred, f)
        tr.headers({":status": "200", "content-type": "text/event-stream"})
        tr.body(b'data: {"choices":[{"text":" a"}]}\n\n', False, f.t0 + ttft)
        for k in range(1, 10):
            tr.body(b'data: {"choices":[{"text":" b"}]}\n\n', False, f.t0 + ttft + k * tpot)
        tr.body(b'data: {"usage":{"completion_tokens":10}}\n\ndata: [DONE]\n\n', True,
                f.t0 + ttft + 9 * tpot)


def test_latency_scorer_avoids_the_endpoint_predicted_to_miss(tmp_path):
    app = _app(tmp_path, [{"type": "latency", "weight": 4, "minSamples": 5}], n=2,
               flow_control=False)
    slow = sorted(e.address for e in app.pool.all())[0]
    _teach(app, 60, slow=slow)
    snap = app.predictor.snapshot()
    assert snap["ttft"]["samples"] == 60 and snap["output_len"]["samples"] == 60
    picks = [app.director.handle({**HEADERS, **SLO}, _body(f"q {i}")).endpoint.address
             for i in range(20)]
    assert slow not in picks
    get = app.metrics.registry.get_sample_value
    assert get("kvyard:slo_requests_total", {"class": "standard"}) == 60
    assert 0.0 < get("kvyard:slo_attainment", {"class": "standard"}) < 1.0


def test_slo_admission_sheds_sheddable_requests_no_endpoint_can_meet(tmp_path):
    app = _app(tmp_path, [{"type": "latency", "weight": 4, "minSamples": 5, "admission": True}],
               n=2, flow_control=False)
    assert type(app.director.admission) is SloAdmission
    pred = app.predictor
    for e in app.pool.all():  # every endpoint answers in 3 s TTFT / 300 ms TPOT
        _teach_one_slow(app, e.address, 60)
        e.pending = 0  # as a scrape would: the pool is not saturated, only slow
    shed = app.director.handle({**HEADERS, **SLO, "x-llm-d-inference-objective": "-1"},
                               _body("batch"))
    assert isinstance(shed, Rejection) and shed.status == 429
    assert dict(shed.headers)[DROPPED_REASON_HEADER] == "rejected-slo-unattainable"
    kept = app.director.handle({**HEADERS, **SLO}, _body("interactive"))
    assert type(kept) is Decision  # not sheddable: routed to the least late
    plain = app.director.handle({**HEADERS, "x-llm-d-inference-objective": "-1"},
                                _body("no slo"))
    assert type(plain) is Decision  # no SLO headers: admission as today
    assert pred.snapshot()["in_flight"] >= 0


def _teach_one_slow(app: EppApp, address: str, n: int) -> None:
    pred = app.predictor
    ep = app.pool.get(address)
    from kvyard.epp.scheduling.types import SchedRequest
    from kvyard.epp.prompt import LazyPrompt
    from kvyard.epp.slo.headers import FACTS, RequestFacts, Slo
    for _ in range(n):
        req = SchedRequest("m", LazyPrompt.of_hashes([1, 2]), now=time.monotonic())
        req.cycle.write(FACTS, RequestFacts(Slo(0.5, 0.05), 128, 64, "", "m"))
        f = pred.start(req, ep)
        pred.claim(req.prompt)
        pred.first_token(f, f.t0 + 3.0)
        pred.finish(f, f.t0 + 3.0 + 9 * 0.3, 10, 10)


def test_predictive_scaler_term_reports_the_forecast(tmp_path):
    app = _app(tmp_path, [{"type": "latency", "weight": 4}], n=2, flow_control=False,
               scaler_port=0)
    p = ScaledObjectParams("default", "both", 1.0, 1.0, 0.05, 0.8)
    idle = app.scaler.servicer.read(p)
    assert idle.predicted == 0.0 and not idle.active
    for i in range(300):
        d = app.director.handle({**HEADERS, **SLO}, _body("x " * 500 + str(i), 200))
        assert type(d) is Decision
    r = app.scaler.servicer.read(p)
    assert r.active and r.predicted > 0 and r.metric >= r.predicted
    assert math.isfinite(r.metric)


def test_latency_scorer_never_pulls_a_request_off_its_cached_endpoint(tmp_path):
    """The cached endpoint is predicted late, a cold one to meet: moving the request would
    make the pool recompute its prompt, so the cold endpoint scores in the late band too
    (the prefix and load scorers decide); within `moveTokens` of the best match it does not."""
    from kvyard.epp.scheduling.cycle import PREFIX_MATCHES
    from kvyard.epp.slo.wiring import latency_scorers
    from kvyard.epp.scheduling.types import SchedRequest
    from kvyard.epp.prompt import LazyPrompt
    from kvyard.epp.slo.headers import FACTS, RequestFacts, Slo

    app = _app(tmp_path, [{"type": "latency", "weight": 4, "minSamples": 5}], n=2, flow_control=False)
    cached, cold = sorted(e.address for e in app.pool.all())
    _teach(app, 60, slow=cached)
    scorer = latency_scorers(app.director.scheduler)[0]
    eps = sorted(app.pool.all(), key=lambda e: e.address)

    def scores(matched: dict[str, int]) -> list[float]:
        req = SchedRequest("m", LazyPrompt.of_hashes(list(range(64))), now=time.monotonic())
        req.cycle.write(FACTS, RequestFacts(Slo(0.5, 0.05), 1024, 64, "", "m"))
        req.cycle.write(PREFIX_MATCHES, matched)
        return scorer.score(req, eps)

    bs = LazyPrompt.of_hashes([1]).block_size
    far = scores({cached: 1024 // bs, cold: 0})        # the cold endpoint lacks 1,024 tokens
    assert far[0] <= 0.2 and far[1] <= 0.2
    near = scores({cached: 1024 // bs, cold: (1024 - 128) // bs})  # 128 tokens short: ranked
    assert near[0] <= 0.2 and near[1] >= 0.8
    fresh = scores({})                                  # a cold prompt everywhere: ranked
    assert fresh[0] <= 0.2 and fresh[1] >= 0.8
