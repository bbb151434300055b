"""P/D between real workers with an int8 KV cache: the decode worker pulls the prefill's
quantized blocks (codes and scales) over the peer transport and answers as an int8
worker serving alone does; a bf16/float32-KV decode worker never takes int8 blocks (the
namespace differs) and computes the prompt itself."""
from __future__ import annotations

from typing import Iterator

import pytest

from kvyard.common import wire
from kvyard.workers.server.testing import WorkerProcess, start_worker

INT8 = ["--kv-cache-dtype", "int8"]


@pytest.fixture(scope="module")
def workers(tmp_path_factory, key_file, demo_gguf) -> Iterator[dict[str, WorkerProcess]]:
    import os

    from kvyard.common import pd_auth

    env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
    env[pd_auth.KEY_ENV] = str(key_file)
    args = ["--model", "demo", "--dtype", "float32", "--max-model-len", "2048",
            "--kv-cache-memory-bytes", "64MiB", "--num-threads", "1", *INT8]
    started: dict[str, WorkerProcess] = {}
    try:
        for name, role in (("prefill_int8", ["prefill", "--kv-hold-timeout", "5"]), ("decode_int8", ["decode"])):
            started[name] = start_worker([*args, "--role", *role],
                                         tmp_path_factory.mktemp(name) / f"{name}.log", env=env)
        yield started
    finally:
        for w in started.values():
            w.stop()


def test_int8_blocks_hand_off_between_int8_workers(pdh, workers, key_file) -> None:
    pre, dec = workers["prefill_int8"], workers["decode_int8"]
    user = "Which river flows through Lyon? (int8)"
    want = pdh.reference(pre, user)
    before = pdh.scrape(dec.base_url)
    status, got = pdh.post(dec.base_url, pdh.body(user), pdh.signed(key_file, pdh.prefill_address(pre)))
    assert status == 200, got
    assert pdh.text_of(got) == pdh.text_of(want)
    after = pdh.scrape(dec.base_url)
    peer = f'{wire.M_PD_HANDOFFS}{{path="peer"}}'
    assert after[peer] == before[peer] + 1
    blocks = (want["usage"]["prompt_tokens"] - 1) // 16
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 16
    moved = after[wire.M_PD_HANDOFF_BYTES] - before[wire.M_PD_HANDOFF_BYTES]
    per_block = 30 * 2 * 16 * 3 * (64 + 4)   # layers x K/V x tokens x kv heads x (codes + scale)
    assert moved >= blocks * per_block and moved < blocks * per_block * 2, "int8 blocks: ~1/4 of float32's"


def test_unlike_kv_dtypes_never_mix(pdh, workers, decode, key_file, wait_until) -> None:
    """A float32-KV decode worker given an int8 prefill worker: the offer's namespace differs,
    so it computes the prompt itself and answers as it would alone."""
    pre = workers["prefill_int8"]
    user = "Which river flows through Bordeaux? (mixed)"
    before = pdh.scrape(decode.base_url)
    status, got = pdh.post(decode.base_url, pdh.body(user), pdh.signed(key_file, pdh.prefill_address(pre)))
    assert status == 200, got
    status, alone = pdh.post(decode.base_url, pdh.body(user))
    assert status == 200, alone
    assert pdh.text_of(got) == pdh.text_of(alone)
    after = pdh.scrape(decode.base_url)
    peer = f'{wire.M_PD_HANDOFFS}{{path="peer"}}'
    assert after.get(peer, 0.0) == before.get(peer, 0.0)

    def fallbacks(doc: dict[str, float]) -> float:
        return sum(v for k, v in doc.items() if k.startswith(wire.M_PD_FALLBACKS + "{"))
    assert fallbacks(after) > fallbacks(before)
    wait_until(lambda: pdh.kv_usage(pre) == 0.0, timeout=60, what="the int8 hold released")
