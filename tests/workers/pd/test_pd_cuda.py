"""P/D handoffs from GPU caches (issue 19): a prefill and two decode `kvyard worker --device
cuda --dtype float32` processes on the demo model. Greedy output through the handoff equals
the prefill worker's own colocated output token for token, for a prompt of a few hundred
tokens (tens of blocks move) and a short one, streamed while the prefill computes (in
32-token chunks) over the same-host memfd (`--pd-transports shm`) and over TCP (`tcp`), and
pulled after it (`--no-pd-stream`); the decode worker counts the peer handoff, the
transport and the streamed blocks; the prefill worker frees the held blocks once pulled. Skipped without CUDA (CI has none).

Self-sufficient, so it also runs under tools/device_gpu.sh's `pytest --noconftest` (the GPU
host lacks openai, which tests/workers/conftest.py imports): its fixtures are here, and the
P/D helpers come from this folder's conftest, loaded by path.
"""
from __future__ import annotations

import importlib.util
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvyard.common import wire  # noqa: E402
from kvyard.common.models import DEMO_SERVED_NAME  # noqa: E402
from kvyard.kvstore.layout import KVLayout  # noqa: E402


def _load_helpers():
    spec = importlib.util.spec_from_file_location("kvyard_pd_cuda_helpers",
                                                  Path(__file__).with_name("conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


h = _load_helpers()

# The demo model's KV block in float32: 30 layers x K,V x 16 tokens x 3 KV heads x 64.
DEMO_F32 = KVLayout("float32", 16, 30, 3, 64)
ARGS = ["--model", "demo", "--device", "cuda", "--dtype", "float32", "--max-model-len", "2048",
        "--kv-cache-memory-bytes", "256MiB", "--max-num-seqs", "8"]
LONG = ("Describe the geography of Europe, region by region: "
        + "its rivers, its mountain ranges, its plains, its islands and its coasts; " * 30)
SHORT = "Name a mountain in the Alps."


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> Iterator[dict]:
    """The prefill worker and one decode worker per transport, started side by side."""
    key = tmp_path_factory.mktemp("pd-cuda") / "pd.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    env = h._env(key)
    specs = {"prefill": ["--role", "prefill", "--kv-hold-timeout", "60",
                         "--max-num-batched-tokens", "32"],   # a long prompt streams by chunk
             "shm": ["--role", "decode", "--pd-transports", "shm"],
             "tcp": ["--role", "decode", "--pd-transports", "tcp"],
             "pull": ["--role", "decode", "--pd-transports", "shm", "--no-pd-stream"]}
    with ThreadPoolExecutor(len(specs)) as pool:
        futs = {name: pool.submit(h.start_worker, [*ARGS, *extra],
                                  tmp_path_factory.mktemp(name) / f"{name}.log", env=env)
                for name, extra in specs.items()}
        started = {}
        try:
            for name, f in futs.items():
                started[name] = f.result()
        except BaseException:
            for w in started.values():
                w.stop()
            raise
    yield {"key": key, **started}
    for w in started.values():
        w.stop()


def _body(user: str) -> dict:
    # no system prompt of the test's own: the short prompt stays short (the chat
    # template's default one makes it a couple of blocks)
    return {"model": DEMO_SERVED_NAME, "temperature": 0, "max_tokens": 24, "ignore_eos": True,
            "messages": [{"role": "user", "content": user}]}


def _until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)  # a poll interval under a deadline


def _fallbacks(w) -> float:
    return sum(v for k, v in h.scrape(w.base_url).items() if k.startswith(wire.M_PD_FALLBACKS))


@pytest.mark.parametrize("prompt", ["long", "short"])
@pytest.mark.parametrize("transport", ["shm", "tcp", "pull"])
def test_handoff_from_gpu_caches_gives_the_colocated_output(workers, transport, prompt) -> None:
    """Streamed while the prefill computes (shm, tcp) and pulled after it (pull: shm)."""
    prefill, decode = workers["prefill"], workers[transport]
    streamed = transport != "pull"
    # no cache shared across cases: the tag comes first
    user = f"({transport}) {LONG if prompt == 'long' else SHORT}"
    before, pre_before = h.scrape(decode.base_url), h.scrape(prefill.base_url)
    falls = _fallbacks(decode)
    # the handoff first, so the blocks it moves are computed fresh by its prefill leg
    status, got = h.post(decode.base_url, _body(user),
                         h.signed(workers["key"], h.prefill_address(prefill)))
    assert status == 200, got
    status, want = h.post(prefill.base_url, _body(user))  # colocated: the oracle
    assert status == 200, want
    assert h.text_of(got) == h.text_of(want)
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 24
    blocks = (want["usage"]["prompt_tokens"] - 1) // 16
    assert blocks >= (20 if prompt == "long" else 1), want["usage"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 16

    after = h.scrape(decode.base_url)
    peer = f'{wire.M_PD_HANDOFFS}{{path="peer"}}'
    assert after[peer] == before[peer] + 1
    for t in ("shm", "tcp"):
        key = f'{wire.M_PD_TRANSFERS}{{transport="{t}"}}'
        assert after[key] == before[key] + (t == transport.replace("pull", "shm")), t
    during, late = (after[k] - before[k] for k in (
        f'{wire.M_PD_STREAMED_BLOCKS}{{when="{w}"}}' for w in ("during_prefill", "after_prefill")))
    assert during + late == (blocks if streamed else 0)
    if streamed and prompt == "long":
        assert during > 0, "no block arrived while the prefill computed"
    assert _fallbacks(decode) == falls
    assert after[wire.M_PD_HANDOFF_BYTES] - before[wire.M_PD_HANDOFF_BYTES] \
        >= blocks * DEMO_F32.nbytes

    pulled = f'{wire.M_PD_HOLDS}{{outcome="pulled"}}'
    _until(lambda: h.scrape(prefill.base_url)[pulled] == pre_before[pulled] + 1, 30,
           "the hold counted as pulled")
    _until(lambda: h.scrape(prefill.base_url)[wire.M_PD_HELD_BLOCKS] == 0.0
           and h.kv_usage(prefill) == 0.0, 60, "the prefill worker's held blocks freed")
