"""Run what the operator renders for two base models and, where the build has LoRA in the
engine, an adapter of the second: both pools' workers, the EPP with its models file and Envoy as
local processes; a request goes to its model's pool through the rendered gateway, the
gateway lists both models, an unknown model is a 404."""
from __future__ import annotations

import copy
import importlib.util
import json
import urllib.error
import urllib.request

from kvyard.common import wire
from kvyard.operator.localrun import LocalRun
from kvyard.operator.render import render_all
from kvyard.operator.spec import parse

from .test_run_rendered import seed_kernel_cache

CR = {"metadata": {"name": "demo", "namespace": "team-a", "uid": "u-1", "generation": 1},
      "spec": {"model": {"source": "demo"}, "engine": {"device": "cpu", "maxModelLen": 1024},
               "pools": {"both": {"replicas": 1}},
               "models": [{"name": "beta", "model": {"source": "demo"}}]}}


def _adapter(tmp_path) -> dict | None:
    """A random PEFT adapter for the demo model (rank 8) served by beta's pool, when the
    build has LoRA in the engine (`kvyard.bench._lora_files`)."""
    if importlib.util.find_spec("kvyard.bench._lora_files") is None:
        return None
    from kvyard.bench._lora_files import write_adapter
    from kvyard.common.models import resolve_model
    from kvyard.workers.model.config import config_from_gguf
    from kvyard.workers.model.gguf_file import GGUFFile

    f = GGUFFile(resolve_model("demo").path)
    cfg = config_from_gguf(f.meta, {n: t.shape for n, t in f.tensors.items()})
    path = write_adapter(tmp_path / "adapters" / "tone", cfg, rank=8, seed=1)
    return {"name": "tone", "model": "beta", "rank": 8, "source": {"path": str(path)}}


def _post(gateway: str, model: str) -> tuple[int, dict, dict]:
    body = json.dumps({"model": model, "prompt": "Say hello.", "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{gateway}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 - loopback
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_two_rendered_pools_serve_their_models_through_the_rendered_gateway(tmp_path) -> None:
    cr = copy.deepcopy(CR)
    adapter = _adapter(tmp_path)
    if adapter is not None:
        cr["spec"]["adapters"] = [adapter]
    run = LocalRun(render_all(parse(cr)), tmp_path)
    seed_kernel_cache(run)
    try:
        run.start()
        gateway = run.service_address("demo-gateway", wire.GATEWAY_HTTP_PORT)
        pods = {p.name: f"127.0.0.1:{p.port('http')}" for p in run.pods
                if p.labels.get(wire.COMPONENT_LABEL) == "worker"}
        assert set(pods) == {"demo-both", "demo-beta-both"}
        served = [("SmolLM2-135M-Instruct", "demo-both"), ("beta", "demo-beta-both")]
        if adapter is not None:
            served.append(("tone", "demo-beta-both"))
        for model, pod in served:
            for _ in range(2):
                status, headers, doc = _post(gateway, model)
                assert status == 200, doc
                assert headers[wire.ENDPOINT_HEADER] == pods[pod]
                assert doc["model"] == model and doc["usage"]["completion_tokens"] == 4
        status, _, doc = _post(gateway, "gamma")
        assert status == 404 and doc["error"]["code"] == "model_not_found"
        with urllib.request.urlopen(f"http://{gateway}/v1/models", timeout=10) as r:  # noqa: S310
            listed = {m["id"]: m["parent"] for m in json.loads(r.read())["data"]}
        assert {"SmolLM2-135M-Instruct", "beta"} <= set(listed)
        if adapter is not None:
            assert listed["tone"] == "beta"
    finally:
        run.stop()
