"""Precise prefix routing as the operator renders it: every worker (kvyard's or stock
vLLM's) publishes its KV events on the conventional ports, its pod annotations name them
(read back by the EPP's own Kubernetes discovery), and the EPP's config scores by them
wherever it has the workers' tokenizer."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import yaml

from kvyard.cli import build_parser
from kvyard.common import wire
from kvyard.common.kv_events import KVEventsConfig
from kvyard.operator.render import render_all
from kvyard.operator.spec import parse

EXAMPLES = Path(__file__).resolve().parents[2] / "operator" / "examples"
PD = {"pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}


def _children(spec: dict, name: str = "demo") -> list[dict]:
    return render_all(parse({"metadata": {"name": name, "namespace": "team-a", "uid": "u",
                                          "generation": 1}, "spec": spec}))


def _deps(children: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in children if o["kind"] == "Deployment"}


def _scheduler(children: list[dict]) -> dict:
    cm = next(o for o in children if o["kind"] == "ConfigMap" and o["metadata"]["name"]
              .endswith("-epp"))
    return yaml.safe_load(cm["data"]["scheduler.yaml"])


def _prefix_scorers(cfg: dict) -> set[str]:
    return {s["type"] for p in cfg["profiles"].values() for s in p["scorers"]
            if "prefix" in s["type"]}


def test_kvyard_workers_publish_on_the_ports_their_annotations_name() -> None:
    from kvyard.epp.pool.discovery_k8s import (KV_EVENTS_PORT_ANNOTATION,
                                                KV_REPLAY_PORT_ANNOTATION, pod_endpoint)

    assert (KV_EVENTS_PORT_ANNOTATION, KV_REPLAY_PORT_ANNOTATION) == \
        (wire.KV_EVENTS_PORT_ANNOTATION, wire.KV_REPLAY_PORT_ANNOTATION)
    children = _children(PD)
    for name in ("demo-prefill", "demo-decode"):
        tmpl = _deps(children)[name]["spec"]["template"]
        (c,) = tmpl["spec"]["containers"]
        cfg = build_parser(c["args"]).parse_args(c["args"]).kv_events_config
        assert isinstance(cfg, KVEventsConfig) and cfg.active
        ann = tmpl["metadata"]["annotations"]
        assert cfg.endpoint == f"tcp://*:{ann[wire.KV_EVENTS_PORT_ANNOTATION]}"
        assert cfg.replay_endpoint == f"tcp://*:{ann[wire.KV_REPLAY_PORT_ANNOTATION]}"
        # the EPP's discovery turns a Ready pod with these annotations into its streams
        pod = SimpleNamespace(
            metadata=SimpleNamespace(deletion_timestamp=None, labels=tmpl["metadata"]["labels"],
                                     annotations=ann),
            status=SimpleNamespace(pod_ip="10.1.2.3", phase="Running",
                                   conditions=[SimpleNamespace(type="Ready", status="True")]))
        ep = pod_endpoint(pod, wire.WORKER_HTTP_PORT)
        assert (ep.kv_events, ep.kv_replay) == (
            f"tcp://10.1.2.3:{wire.WORKER_KV_EVENTS_PORT}",
            f"tcp://10.1.2.3:{wire.WORKER_KV_REPLAY_PORT}")
    assert _prefix_scorers(_scheduler(children)) == {"precise-prefix-cache"}


def test_the_epp_scores_by_events_only_with_the_workers_tokenizer() -> None:
    from kvyard.epp.scheduling.config import build_scheduler

    demo = _children({"model": {"source": "demo"}})
    assert _prefix_scorers(_scheduler(demo)) == {"precise-prefix-cache"}
    build_scheduler(_scheduler(demo))
    hf = _children({"model": {"source": "hf", "path": "/models/smol"}})
    epp = next(c for d in _deps(hf).values() if d["metadata"]["name"] == "demo-epp"
               for c in d["spec"]["template"]["spec"]["containers"])
    assert epp["args"][epp["args"].index("--model") + 1] == "none"
    assert _prefix_scorers(_scheduler(hf)) == {"prefix-cache"}  # no tokenizer: approximate


def test_stock_vllm_pods_publish_the_same_way() -> None:
    obj = yaml.safe_load((EXAMPLES / "vllm.yaml").read_text())
    children = _children(obj["spec"], "qwen")
    tmpl = _deps(children)["qwen-decode"]["spec"]["template"]
    (c,) = tmpl["spec"]["containers"]
    cfg = json.loads(c["args"][c["args"].index("--kv-events-config") + 1])
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://*:{wire.WORKER_KV_EVENTS_PORT}",
                   "replay_endpoint": f"tcp://*:{wire.WORKER_KV_REPLAY_PORT}"}
    assert KVEventsConfig.parse(json.dumps(cfg)).active
    assert tmpl["metadata"]["annotations"][wire.KV_EVENTS_PORT_ANNOTATION] == "5557"
    assert _prefix_scorers(_scheduler(children)) == {"precise-prefix-cache"}
