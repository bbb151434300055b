"""P/D through the whole local stack: `kvyard up --prefill 1 --decode 1` as processes
(stand-ins: roles, key, EPP config, supervision), and with real workers on the demo
model, where the greedy output through Envoy equals the colocated output.

The colocated reference is the stack's prefill worker asked directly, without
kv_transfer_params: the same engine, flags and dtype serving the request alone.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from kvyard.common import wire
from kvyard.common.models import DEMO_SERVED_NAME, ModelNotFound, demo_gguf_path
from kvyard.stack import procs
from kvyard.stack.launch import start_stack, stop_stack
from kvyard.stack.spec import StackSpec
from kvyard.stack.state import StackState

SYSTEM = ("You are a helpful assistant for travellers. You answer questions about cities, "
          "rivers and mountains with care, in one or two sentences. ") * 12


def _native_bf16() -> bool:
    from kvyard.workers.engine.model_runner import cpu_has_native_bf16

    return cpu_has_native_bf16()


DTYPES = ["float32"] + (["bfloat16"] if _native_bf16() else [])


def chat(user: str, stream: bool = False) -> dict:
    """Each user text gets its own system prompt variant: a shared one would be cached
    on the decode worker after the first request, and the EPP would not split again."""
    system = f"Conversation about: {user}\n{SYSTEM}"
    return {"model": DEMO_SERVED_NAME, "temperature": 0, "max_tokens": 12, "stream": stream,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}


def answer(reply) -> str:
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        out = []
        for line in reply.body.decode().splitlines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"]
                if ch and ch[0]["delta"].get("content"):
                    out.append(ch[0]["delta"]["content"])
        return "".join(out)
    return reply.json()["choices"][0]["message"]["content"]


def handoffs(address: str) -> float:
    code, body = procs.http_get(f"http://{address}/metrics")
    assert code == 200
    for line in body.decode().splitlines():
        if line.startswith(f'{wire.M_PD_HANDOFFS}{{path="peer"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no handoff counter")


def test_up_prefill_decode_writes_roles_key_and_pd_config(up, h, wait_until) -> None:
    state = up("--prefill", "1", "--decode", "2")
    rd = Path(up.run_dir)
    entries = yaml.safe_load((rd / "endpoints.yaml").read_text())
    assert [e["role"] for e in entries] == ["prefill", "decode", "decode"]
    assert [e["address"] for e in entries] == state.endpoints
    key = rd / "pd.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_text().strip()) >= 32
    epp = next(p for p in state.procs if p.name == "epp")
    assert "--pd-key-file" in epp.cmd and str(key) in epp.cmd
    assert epp.cmd[epp.cmd.index("--config") + 1].endswith("scheduler.pd.example.yaml")
    for p, role in zip([p for p in state.procs if p.name.startswith("worker-")],
                       ["prefill", "decode", "decode"]):
        assert p.cmd[p.cmd.index("--role") + 1] == role and str(key) in p.cmd
    st = h.kvyard("status", "--json", "--run-dir", str(rd))
    assert st.returncode == 0, st.stderr
    rows = {r["address"]: r for r in json.loads(st.stdout)["endpoints"]}
    assert [rows[a]["role"] for a in state.endpoints] == ["prefill", "decode", "decode"]
    # the supervisor restarts a worker with its role and key
    worker = next(p for p in state.procs if p.name == "worker-1")
    os.kill(worker.pid, 9)

    def restarted():
        s = StackState.load(rd)
        w = next(p for p in s.procs if p.name == "worker-1")
        return w if w.pid != worker.pid and procs.http_ok(f"http://{state.endpoints[1]}/health") \
            else None
    w = wait_until(restarted, timeout=60, interval=0.1, what="worker-1 restarted")
    assert w.cmd == worker.cmd


def test_up_refuses_half_a_split(h, tmp_path) -> None:
    done = h.kvyard("up", "--standin-workers", "--prefill", "1", "--run-dir", str(tmp_path))
    assert done.returncode == 2 and "--decode" in done.stderr


@pytest.fixture(scope="module", params=DTYPES)
def pd_stack(request, tmp_path_factory):
    try:
        demo_gguf_path()
    except ModelNotFound as e:
        pytest.skip(str(e))
    spec = StackSpec(run_dir=tmp_path_factory.mktemp(f"pd-{request.param}"), prefill=1, decode=1,
                     dtype=request.param, gateway_port=None, worker_base_port=None,
                     epp_ports=(None, None, None), admin_port=None, scaler_port=None,
                     ready_timeout_s=300.0,
                     worker_args=["--max-model-len", "2048", "--kv-cache-memory-bytes", "128MiB",
                                  "--num-threads", "1"])
    state = start_stack(spec)
    try:
        yield state
    finally:
        stop_stack(state)


def test_greedy_output_through_envoy_equals_colocated(pd_stack, h) -> None:
    prefill_addr, decode_addr = pd_stack.endpoints
    before = handoffs(decode_addr)
    for i, (user, stream) in enumerate([("Which river flows through Vienna?", False),
                                        ("Name a famous square in Madrid.", True)]):
        # not cached anywhere: the EPP splits it
        got = h.request(pd_stack.gateway_url, chat(user, stream), timeout=300)
        assert got.status == 200, got.body
        assert got.endpoint == decode_addr
        assert handoffs(decode_addr) == before + i + 1
        want = h.request(f"http://{prefill_addr}", chat(user, stream), timeout=300)
        assert want.status == 200 and want.endpoint == prefill_addr
        assert answer(got) == answer(want) and answer(got)
        # now cached on the decode worker: no split, its own prefix cache, same output
        again = h.request(pd_stack.gateway_url, chat(user, stream), timeout=300)
        assert again.status == 200 and again.endpoint == decode_addr
        assert answer(again) == answer(want)
        assert handoffs(decode_addr) == before + i + 1
    st = h.kvyard("status", "--json", "--run-dir", pd_stack.run_dir)
    assert st.returncode == 0, st.stderr
    rows = {r["address"]: r for r in json.loads(st.stdout)["endpoints"]}
    assert rows[prefill_addr]["role"] == "prefill" and rows[decode_addr]["role"] == "decode"
    assert rows[decode_addr]["pd"]["handoffs"]["peer"] == before + 2
