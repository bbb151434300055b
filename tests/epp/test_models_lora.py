"""Several models behind one EPP (epp/models.py) and the lora-affinity scorer: a model
goes to its pool, an adapter to its base's pool, an unknown name is a 404, `/v1/models`
lists every pool's models with `parent`; lora-affinity prefers the adapter's endpoints,
then free slots, and remembers what it sent where."""
from __future__ import annotations

import json
import time

import pytest

from kvyard.epp.app import EppApp, EppConfig
from kvyard.epp.models import ModelListing, ModelRoutes
from kvyard.epp.pool.endpoints import Endpoint, EndpointSpec, parse_spec
from kvyard.epp.prompt import LazyPrompt
from kvyard.epp.request import Rejection
from kvyard.epp.scheduling.config import build_scheduler
from kvyard.epp.scheduling.scorers.lora_affinity import LoraAffinityScorer
from kvyard.epp.scheduling.types import Decision, SchedRequest

MODELS = """
models:
  - {name: alpha, adapters: [sql, chat]}
  - {name: beta, pool: beta-pool}
"""


def _app(tmp_path, specs: list[EndpointSpec]) -> EppApp:
    f = tmp_path / "models.yaml"
    f.write_text(MODELS)
    app = EppApp(EppConfig(model="none", seed=1, flow_control=False, models_file=str(f)))
    app.pool.set_source("t", specs)
    for e in app.pool.all():
        e.last_ok = time.monotonic()
    return app


def _chat(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()


H = {":method": "POST", ":path": "/v1/chat/completions"}


def test_model_goes_to_its_pool_unknown_is_404_and_models_lists_all(tmp_path) -> None:
    specs = [parse_spec({"address": f"10.0.0.{i}:8000", "pool": p})
             for i, p in ((1, "alpha"), (2, "alpha"), (3, "beta-pool"))]
    app = _app(tmp_path, specs)
    for _ in range(5):
        assert app.director.handle(H, _chat("beta")).endpoint.address == "10.0.0.3:8000"
        d = app.director.handle(H, _chat("sql"))
        assert type(d) is Decision and d.endpoint.pool == "alpha"
    nope = app.director.handle(H, _chat("gamma"))
    assert isinstance(nope, Rejection) and nope.status == 404
    assert json.loads(nope.body())["error"]["code"] == "model_not_found"
    listing = app.director.handle({":method": "GET", ":path": "/v1/models"}, None)
    assert isinstance(listing, ModelListing) and listing.status == 200
    data = {m["id"]: m["parent"] for m in json.loads(listing.body())["data"]}
    assert data == {"alpha": None, "sql": "alpha", "chat": "alpha", "beta": None}


def test_routes_refuse_bad_tables() -> None:
    for bad, why in (({"models": []}, "non-empty"), ([{"name": "a"}, {"name": "a"}], "twice"),
                     ([{"name": "a", "adapters": ["a"]}], "twice"),
                     ([{"name": "a", "weights": 1}], "unknown key"), ([{"name": ""}], "name")):
        with pytest.raises(ValueError, match=why):
            ModelRoutes.parse(bad)
    with pytest.raises(ValueError, match="pool"):
        parse_spec({"address": "10.0.0.1:8000", "pool": 3})


def _req(adapter: str) -> SchedRequest:
    return SchedRequest(adapter or "base", LazyPrompt.of_hashes([]), adapter=adapter)


def test_lora_affinity_active_then_room_then_evicting() -> None:
    s = LoraAffinityScorer()
    has = Endpoint("a:1", lora_running=frozenset({"sql"}), max_lora=2)
    room = Endpoint("b:1", lora_running=frozenset({"x"}), max_lora=2)
    full = Endpoint("c:1", lora_running=frozenset({"x"}), lora_waiting=frozenset({"y"}),
                    max_lora=2)
    assert s.score(_req("sql"), [has, room, full]) == [1.0, 0.8, 0.0]
    assert s.score(_req(""), [has, room, full]) == [1.0, 1.0, 1.0]   # base: no preference
    # what it sent stays active there (vLLM's LRU keeps it after the request ends) ...
    s.pre_request(_req("chat"), room)
    assert s.score(_req("chat"), [has, room, full]) == [0.8, 1.0, 0.0]
    # ... and fills the slots: b has x (running) and chat, so a third adapter finds no room
    assert s.score(_req("new"), [has, room]) == [0.8, 0.0]
    s.forget("b:1")
    assert s.score(_req("chat"), [room]) == [0.8]


def test_lora_affinity_keeps_an_adapter_on_its_pod_through_the_scheduler() -> None:
    cfg = {"profiles": {"default": {"filters": [], "scorers": [
        {"type": "lora-affinity", "weight": 5}, {"type": "queue", "weight": 1}],
        "picker": {"type": "max-score"}}}}
    sched = build_scheduler(cfg, seed=3)
    eps = [Endpoint(f"10.0.0.{i}:80", max_lora=1, last_ok=time.monotonic()) for i in range(4)]
    picks = {a: {sched.schedule(_req(a), eps).endpoint.address for _ in range(6)}
             for a in ("p", "q", "r", "s")}
    assert all(len(v) == 1 for v in picks.values())          # each adapter stays on one pod
    assert len({next(iter(v)) for v in picks.values()}) == 4  # and they spread over the pods
