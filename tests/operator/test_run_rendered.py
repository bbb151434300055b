"""Run what the operator renders: the Deployments and ConfigMaps of a CPU
InferenceService (demo model, one worker) as local processes with their own
commands, args and env (kvyard.operator.localrun: ports and mount paths mapped to
loopback and a temp dir; the EPP's Kubernetes discovery replaced by an endpoints
file, since there is no API server), then an OpenAI chat request through the Envoy
they configured. Broken renderings (an unknown flag, a config Envoy refuses, a
port that does not line up) must fail the run."""
from __future__ import annotations

import copy
import json
import shutil
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvyard.common import wire
from kvyard.operator.localrun import LocalRun, RenderedRunError
from kvyard.operator.render import render_all
from kvyard.operator.spec import parse
from kvyard.stack.procs import StartupError, free_port, http_ok

CR = {"metadata": {"name": "demo", "namespace": "team-a", "uid": "u-1", "generation": 1},
      "spec": {"model": {"source": "demo"}, "engine": {"device": "cpu", "maxModelLen": 2048},
               "pools": {"both": {"replicas": 1}}, "kvstore": {"dramGB": 0.25}}}


def children() -> list[dict]:
    return render_all(parse(copy.deepcopy(CR)))


def seed_kernel_cache(run: LocalRun) -> None:
    """A pod's cache emptyDir starts empty and the worker compiles its CPU kernels
    there; here it gets this machine's compiled ones, to skip a minute of compiling."""
    src = Path.home() / ".cache" / "kvyard" / "kernels"
    for pod in run.pods:
        if pod.labels.get(wire.COMPONENT_LABEL) != "worker" or not src.is_dir():
            continue
        cache = next(m["mountPath"] for m in pod.container["volumeMounts"]
                     if m["name"] == "cache")
        shutil.copytree(src, pod.root / cache.lstrip("/") / "kernels", dirs_exist_ok=True)


def chat(address: str, text: str, headers: dict | None = None) -> tuple[int, dict, dict]:
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request(f"http://{address}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 - loopback
        return r.status, dict(r.headers), json.loads(r.read())


def test_rendered_pods_serve_a_chat_request_through_the_rendered_gateway(tmp_path) -> None:
    run = LocalRun(children(), tmp_path)
    seed_kernel_cache(run)
    try:
        run.start()
        gateway = run.service_address("demo-gateway", wire.GATEWAY_HTTP_PORT)
        status, headers, doc = chat(gateway, "Say hello.")
        worker = run.pod("worker")
        # The EPP picked the one worker, which names itself by its advertised address.
        assert status == 200
        assert headers[wire.ENDPOINT_HEADER] == f"127.0.0.1:{worker.port('http')}"
        assert doc["object"] == "chat.completion"
        assert doc["choices"][0]["message"]["content"].strip()
        assert doc["usage"]["completion_tokens"] >= 1
        # The EPP saw it: its pick counter for that endpoint moved (/debug/endpoints).
        epp = run.pod("epp")
        with urllib.request.urlopen(  # noqa: S310 - loopback
                f"http://127.0.0.1:{epp.port('metrics')}/debug/endpoints", timeout=5) as r:
            text = r.read().decode()
        assert f"127.0.0.1:{worker.port('http')}" in text
        # A client's own routing header is stripped by the gateway; the EPP still routes.
        status, headers, _ = chat(gateway, "Again.", {wire.DESTINATION_HEADER: "127.0.0.1:9"})
        assert status == 200
        assert headers[wire.ENDPOINT_HEADER] == f"127.0.0.1:{worker.port('http')}"
    finally:
        run.stop()


def _container(objs: list[dict], name: str) -> dict:
    dep = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == name)
    return dep["spec"]["template"]["spec"]["containers"][0]


def test_an_unknown_worker_flag_fails_the_run(tmp_path) -> None:
    objs = children()
    _container(objs, "demo-both")["args"].append("--no-such-flag")
    run = LocalRun(objs, tmp_path)
    try:
        with pytest.raises(StartupError, match="unrecognized arguments: --no-such-flag"):
            run.start(order=("worker",), timeout_s=60)
    finally:
        run.stop()


def test_a_config_envoy_refuses_fails_the_run(tmp_path) -> None:
    objs = children()
    cm = next(o for o in objs if o["kind"] == "ConfigMap"
              and o["metadata"]["name"] == "demo-gateway")
    doc = yaml.safe_load(cm["data"]["envoy.yaml"])
    doc["static_resources"]["clusters"][1]["type"] = "NOT_A_TYPE"
    cm["data"]["envoy.yaml"] = yaml.safe_dump(doc)
    run = LocalRun(objs, tmp_path)
    try:
        with pytest.raises(StartupError, match="gateway exited during startup"):
            run.start(order=("gateway",), timeout_s=30)
    finally:
        run.stop()


def test_a_port_that_does_not_line_up_fails_the_run(tmp_path, wait_until) -> None:
    # The worker listens on a port its containerPort, Service and probe do not name
    # (a free one: a fixed port may be another run's, and then the worker cannot bind).
    wrong = free_port()
    objs = children()
    args = _container(objs, "demo-both")["args"]
    args[args.index("--port") + 1] = str(wrong)
    run = LocalRun(objs, tmp_path)
    seed_kernel_cache(run)
    try:
        with pytest.raises(StartupError, match="demo-both not ready after"):
            run.start(order=("worker",), timeout_s=30)
        # Up and serving, but where nothing routes: its probe on the declared port fails.
        # (On a loaded machine the model may still be loading when the run gives up.)
        worker = run.pod("worker")
        wait_until(lambda: http_ok(f"http://127.0.0.1:{wrong}/health"), timeout=120,
                   interval=0.2, what="the worker serving on the port nothing names")
        assert f"on http://127.0.0.1:{wrong}" in Path(worker.proc.log).read_text()
        assert not run.probe(worker, worker.container["readinessProbe"])
    finally:
        run.stop()
    # A Service whose targetPort names no container port cannot route at all.
    objs = children()
    svc = next(o for o in objs if o["kind"] == "Service"
               and o["metadata"]["name"] == "demo-gateway")
    svc["spec"]["ports"][0]["targetPort"] = "web"
    with pytest.raises(RenderedRunError, match="no port 'web'"):
        LocalRun(objs, tmp_path / "svc").service_address("demo-gateway", 8080)


def _metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_rendered_pd_pools_hand_off_through_the_shared_key(tmp_path) -> None:
    """Prefill + decode pools: the P/D scheduler config, the key Secret mounted in the EPP and
    both workers, the prefill pod's kv-peer port; a long prompt is prefilled on the prefill
    pod and its KV loaded by the decode pod, which answers."""
    from kvyard.operator.render import pd_key_secret

    cr = copy.deepcopy(CR)
    cr["spec"]["pools"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    cr["spec"]["routing"] = {"pd": {"nonCachedTokens": 16}}
    s = parse(cr)
    run = LocalRun(render_all(s) + [pd_key_secret(s, "ab" * 32)], tmp_path)
    seed_kernel_cache(run)
    try:
        run.start()
        gateway = run.service_address("demo-gateway", wire.GATEWAY_HTTP_PORT)
        prompt = "Tell me about the sea. " * 12
        status, headers, doc = chat(gateway, prompt)
        decode = next(p for p in run.pods if p.name == "demo-decode")
        assert status == 200 and doc["choices"][0]["message"]["content"].strip()
        assert headers[wire.ENDPOINT_HEADER] == f"127.0.0.1:{decode.port('http')}"
        with urllib.request.urlopen(  # noqa: S310 - loopback
                f"http://127.0.0.1:{decode.port('http')}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        assert _metric_sum(metrics, wire.M_PD_HANDOFFS) >= 1, \
            [ln for ln in metrics.splitlines() if "pd_" in ln and not ln.startswith("#")]
        assert _metric_sum(metrics, wire.M_PD_REJECTED) == 0
    finally:
        run.stop()
