"""`kvyard worker --enable-lora` over HTTP: vLLM's flags, /v1/models with parents, a request
picking its adapter by `model`, runtime load/unload (with VLLM_ALLOW_RUNTIME_LORA_UPDATING)
and their errors, an unknown model's 404, and vllm:lora_requests_info."""
from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvyard.workers.server.testing import start_worker

sys.path.insert(0, str(Path(__file__).parent))
from lora_adapters import write_peft_adapter  # noqa: E402


def _call(url: str, body: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from kvyard.common.models import resolve_model
    from kvyard.workers.model.config import config_from_gguf
    from kvyard.workers.model.gguf_file import GGUFFile

    d = tmp_path_factory.mktemp("lora")
    f = GGUFFile(resolve_model("demo").path)
    cfg = config_from_gguf(f.meta, {n: t.shape for n, t in f.tensors.items()})
    a = write_peft_adapter(d / "alpha", cfg, seed=1)
    b = write_peft_adapter(d / "beta", cfg, rank=8, modules=("gate_proj", "down_proj"), seed=2)
    big = write_peft_adapter(d / "big", cfg, rank=32, seed=3)
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    w = start_worker(["--dtype", "float32", "--kv-cache-memory-bytes", "64MiB", "--enable-lora",
                      "--lora-modules", f"alpha={a}",
                      "--max-loras", "2", "--max-lora-rank", "16"],
                     d / "worker.log", env=env)
    yield w, {"beta": b, "big": big, "missing": d / "nope"}
    w.stop()


def _complete(w, model: str) -> tuple[int, dict]:
    code, text = _call(w.base_url + "/v1/completions",
                       {"model": model, "prompt": "The sea is", "max_tokens": 8, "temperature": 0})
    return code, json.loads(text)


def test_models_requests_and_runtime_updates(worker):
    w, paths = worker
    code, text = _call(w.base_url + "/v1/models")
    data = {m["id"]: m for m in json.loads(text)["data"]}
    base = next(m for m in data.values() if m["parent"] is None)["id"]
    assert data["alpha"]["parent"] == base

    code, base_out = _complete(w, base)
    code2, alpha_out = _complete(w, "alpha")
    assert code == code2 == 200 and alpha_out["model"] == "alpha"
    assert alpha_out["choices"][0]["text"] != base_out["choices"][0]["text"]

    code, err = _complete(w, "beta")
    assert code == 404 and err["error"]["code"] == "model_not_found"

    code, text = _call(w.base_url + "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": str(paths["beta"])})
    assert code == 200 and text == "Success: LoRA adapter 'beta' added successfully."
    code, text = _call(w.base_url + "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": str(paths["beta"])})
    assert code == 400 and "has already been loaded" in json.loads(text)["error"]["message"]
    code, text = _call(w.base_url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(paths["missing"])})
    assert code == 404 and json.loads(text)["error"]["type"] == "NotFoundError"
    code, text = _call(w.base_url + "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(paths["big"])})
    assert code == 400 and "max_lora_rank" in json.loads(text)["error"]["message"]
    code, text = _call(w.base_url + "/v1/load_lora_adapter", {"lora_name": "y"})
    assert code == 400
    code, beta_out = _complete(w, "beta")
    assert code == 200 and beta_out["choices"][0]["text"] != base_out["choices"][0]["text"]
    ids = {m["id"] for m in json.loads(_call(w.base_url + "/v1/models")[1])["data"]}
    assert {"alpha", "beta"} <= ids and "big" not in ids

    metrics = _call(w.base_url + "/metrics")[1]
    line = next(s for s in metrics.splitlines() if s.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line

    code, text = _call(w.base_url + "/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert code == 200 and text == "Success: LoRA adapter 'beta' removed successfully."
    code, text = _call(w.base_url + "/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert code == 404 and "cannot be found" in json.loads(text)["error"]["message"]
    assert _complete(w, "beta")[0] == 404
    assert _complete(w, "alpha")[1]["choices"][0]["text"] == alpha_out["choices"][0]["text"]
