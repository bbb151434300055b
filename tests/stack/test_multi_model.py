"""`kvyard up --model alpha=demo --model beta=demo --adapter beta:tone=PATH`: two pools behind
the real Envoy and EPP; a request goes to its model's (or its adapter's model's) pool,
`/v1/models` lists both models and the adapter with its parent, an unknown model is a 404."""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvyard.stack import procs
from kvyard.stack.models import parse_adapters, parse_models
from kvyard.stack.state import StackState


def _kvyard(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvyard.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def _call(gateway: str, method: str, path: str, body: dict | None = None
          ) -> tuple[int, dict, dict]:
    host, port = gateway.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
    finally:
        conn.close()


def test_parse_models() -> None:
    assert parse_models(None) == ("demo", [])
    assert parse_models(["/m/x.gguf"]) == ("/m/x.gguf", [])
    assert parse_models(["a=demo", "b=/m"]) == ("demo", [("a", "demo"), ("b", "/m")])
    for bad in (["a=demo", "demo"], ["a=demo", "a=demo"], ["=demo"], ["a b=demo"]):
        with pytest.raises(ValueError):
            parse_models(bad)
    named = [("a", "demo"), ("b", "demo")]
    assert parse_adapters(["x=/p", "b:y=/q"], named) == [("a", "x", "/p"), ("b", "y", "/q")]
    assert parse_adapters(["x=/p"], []) == [("", "x", "/p")]
    for bad in (["c:x=/p"], ["x"], ["a=/p"], ["x=/p", "x=/q"], ["b:=/p"]):
        with pytest.raises(ValueError):
            parse_adapters(bad, named)


def test_two_models_behind_one_gateway(tmp_path: Path) -> None:
    rd = str(tmp_path / "run")
    up = _kvyard("up", "--sim", "2", "--model", "alpha=demo", "--model", "beta=demo",
                 "--adapter", "beta:tone=/adapters/tone", "--max-loras", "2",
                 "--sim-profile", "h100", "--port", str(procs.free_port()), "--run-dir", rd)
    state = StackState.load(Path(rd))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert len(state.endpoints) == 4
        pools = {"alpha": set(state.endpoints[:2]), "beta": set(state.endpoints[2:])}
        for _ in range(3):
            for model, members in (*pools.items(), ("tone", pools["beta"])):
                status, headers, body = _call(state.gateway_url, "POST", "/v1/completions",
                                              {"model": model, "prompt": f"to {model}",
                                               "max_tokens": 2})
                assert status == 200, body
                assert headers["x-kvyard-endpoint"] in members
                assert body["model"] == model
        status, _, body = _call(state.gateway_url, "POST", "/v1/completions",
                                {"model": "gamma", "prompt": "x", "max_tokens": 2})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, _, body = _call(state.gateway_url, "GET", "/v1/models")
        assert status == 200
        assert {m["id"]: m["parent"] for m in body["data"]} == \
            {"alpha": None, "beta": None, "tone": "beta"}
    finally:
        down = _kvyard("down", "--run-dir", rd)
    assert down.returncode == 0, down.stderr
