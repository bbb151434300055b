"""The director: one request's path (parse → admission → scheduling), the one
object both the ext_proc server and the decision benchmark call."""
from __future__ import annotations

import json
import time

from kvyard.bench.epp_api import build_director, latencies
from kvyard.common.wire import DESTINATION_HEADER, DROPPED_REASON_HEADER
from kvyard.epp.admission import SheddingAdmission
from kvyard.epp.app import EppApp, EppConfig
from kvyard.epp.director import Director
from kvyard.epp.flow.controller import FlowController
from kvyard.epp.pool.endpoints import EndpointSpec
from kvyard.epp.request import Rejection
from kvyard.epp.scheduling.types import Decision

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()
HEADERS = {":method": "POST", ":path": "/v1/chat/completions"}


def _app(n: int, **cfg) -> EppApp:
    app = EppApp(EppConfig(model="none", seed=1, **cfg))
    app.pool.set_source("t", [EndpointSpec(f"10.0.0.{i}:8000") for i in range(1, n + 1)])
    for e in app.pool.all():
        e.last_ok = time.monotonic()
    return app


def _spy(monkeypatch) -> list[Director]:
    """Every Director whose `handle` runs, in call order."""
    calls: list[Director] = []
    real = Director.handle

    def spying(self, headers, body):
        calls.append(self)
        return real(self, headers, body)
    monkeypatch.setattr(Director, "handle", spying)
    return calls


def test_handle_returns_a_decision_or_the_rejection_and_counts_both():
    app = _app(2, flow_control=False)
    d = app.director.handle(HEADERS, CHAT)
    assert type(d) is Decision and d.endpoint in app.pool.all()
    bad = app.director.handle(HEADERS, b"{not json")
    assert isinstance(bad, Rejection) and bad.status == 400
    get = app.metrics.registry.get_sample_value
    assert get("kvyard_epp_decision_seconds_count") == 1
    assert get("kvyard_epp_errors_total", {"reason": bad.reason}) == 1


def test_shedding_admission_sheds_sheddable_requests_and_503s_an_empty_pool():
    app = _app(2, flow_control=False)
    assert type(app.director.admission) is SheddingAdmission
    for e in app.pool.all():
        e.waiting = 10  # saturation 2
    shed = app.director.handle({**HEADERS, "x-gateway-inference-objective": "-1"}, CHAT)
    assert isinstance(shed, Rejection) and shed.status == 429
    assert dict(shed.headers)[DROPPED_REASON_HEADER] == "rejected-saturated"
    assert type(app.director.handle(HEADERS, CHAT)) is Decision  # critical: routed anyway
    for e in app.pool.all():
        e.sleeping = True  # the healthy filter leaves nothing
    none = app.director.handle(HEADERS, CHAT)
    assert isinstance(none, Rejection) and none.status == 503
    assert dict(none.headers)[DROPPED_REASON_HEADER] == "rejected-no-endpoints"


def test_flow_control_is_the_default_admission_and_never_holds_a_bodyless_request():
    app = _app(0)
    assert app.director.admission is app.flow and type(app.flow) is FlowController
    # GET /v1/models with no endpoint: 503 at once (a held request would need a loop here)
    out = app.director.handle({":method": "GET", ":path": "/v1/models"}, None)
    assert isinstance(out, Rejection) and out.status == 503


def test_the_bench_times_the_directors_handle(monkeypatch):
    calls = _spy(monkeypatch)
    decide, _ = latencies(4, 200, 3, model="none", warmup=1)
    assert len(decide) == 3 and len(calls) == 4 and len({id(d) for d in calls}) == 1
    # ... of a director wired as `kvyard epp` wires it (EppApp, flow control on)
    d = build_director(4, model="none")
    assert type(d.admission) is FlowController


async def test_the_server_calls_the_apps_director(fake_vllm, epp, xp, monkeypatch):
    w = await fake_vllm()
    app = await epp([w])
    await xp.wait_for(app.is_ready, what="EPP ready")
    assert app.servicer is not None and app.servicer.director is app.director
    seen = _spy(monkeypatch)
    resps = await xp.exchange(app.ports["ext_proc"],
                              [xp.headers_msg(xp.chat_headers()), xp.body_msg(CHAT)])
    assert xp.set_headers(resps[0])[DESTINATION_HEADER] == w.address
    assert seen == [app.director]
