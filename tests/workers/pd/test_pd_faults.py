"""P/D faults between real workers: a damaged, hung or dead prefill, a peer that
cannot be reached, unlike KV layouts: every request still gets the colocated output
(the store's blocks, else a local prefill), and each fallback is counted by reason."""
from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvyard.common import wire


@pytest.mark.parametrize("mode,reason", [("corrupt", "transfer_corrupt"),
                                         ("truncate", "transfer_truncated"),
                                         ("hang", "prefill_timeout")])
def test_damaged_handoffs_fall_back_to_the_same_output(pdh, prefill, decode, key_file, mode,
                                                       reason) -> None:
    user = f"Tell me about Lyon ({mode})."
    want = pdh.reference(prefill, user)
    proxy = pdh.PDProxy(pdh.prefill_address(prefill), mode).start()
    try:
        before = pdh.fallbacks(decode, reason)
        status, got = pdh.post(decode.base_url, pdh.body(user),
                               pdh.signed(key_file, proxy.address))
        assert status == 200, got
        assert pdh.text_of(got) == pdh.text_of(want)
        assert proxy.legs == 1 and proxy.transfers == (0 if mode == "hang" else 1)
        assert pdh.fallbacks(decode, reason) == before + 1
    finally:
        proxy.stop()


def test_prefill_worker_killed_during_and_between_transfers(pdh, tmp_path, key_file, decode,
                                                             prefill) -> None:
    doomed = pdh.start_worker([*pdh.WORKER_ARGS, "--role", "prefill"], tmp_path / "doomed.log",
                              env=pdh.env(key_file))
    proxy = pdh.PDProxy(pdh.prefill_address(doomed), "pause").start()
    user = "Describe the Loire valley."
    want = pdh.reference(prefill, user)
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(pdh.post, decode.base_url, pdh.body(user),
                              pdh.signed(key_file, proxy.address))
            assert proxy.paused.wait(180), "the transfer never started"
            doomed.proc.kill()
            doomed.proc.wait(30)
            proxy.resume.set()
            status, got = fut.result(timeout=180)
        assert status == 200, got
        assert pdh.text_of(got) == pdh.text_of(want)
        # between requests: the prefill worker is gone, its address refuses connections
        before = pdh.fallbacks(decode, "prefill_unreachable")
        user2 = "Describe the Rhone valley."
        status, got = pdh.post(decode.base_url, pdh.body(user2),
                               pdh.signed(key_file, pdh.prefill_address(doomed)))
        assert status == 200, got
        assert pdh.text_of(got) == pdh.text_of(pdh.reference(prefill, user2))
        assert pdh.fallbacks(decode, "prefill_unreachable") == before + 1
    finally:
        proxy.stop()
        if doomed.proc.poll() is None:
            doomed.proc.kill()


def test_blocks_come_from_the_shared_store_when_the_peer_fails(pdh, tmp_path, key_file, wait_until
                                                               ) -> None:
    """Both workers on one pool tier (a shared SSD dir, as `kvyard up` gives them): a
    peer that cannot be reached costs the decode worker no prefill."""
    ssd = tmp_path / "kvcache"
    kv = ["--kv-dram-gb", "0.1", "--kv-ssd-dir", str(ssd), "--kv-ssd-gb", "1"]
    pw = pdh.start_worker([*pdh.WORKER_ARGS, *kv, "--role", "prefill"], tmp_path / "p.log",
                          env=pdh.env(key_file))
    dw = pdh.start_worker([*pdh.WORKER_ARGS, *kv, "--role", "decode"], tmp_path / "d.log",
                          env=pdh.env(key_file))
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    proxy = pdh.PDProxy(pdh.prefill_address(pw), "dead_peer")
    proxy.closed_port = closed.getsockname()[1]
    closed.close()
    user = "What is the oldest bridge in Prague?"
    prompt_blocks = []

    def stored() -> None:
        wait_until(lambda: len(list(ssd.rglob("*.kvb"))) >= prompt_blocks[0], timeout=60,
                   what="the prefill worker's blocks on the shared SSD")
    proxy.before_answer = stored
    proxy.start()
    try:
        status, ref = pdh.post(pw.base_url, pdh.body(user))  # colocated answer, block count
        assert status == 200, ref
        prompt_blocks.append((ref["usage"]["prompt_tokens"] - 1) // 16)
        for p in ssd.rglob("*.kvb"):                   # the store starts empty for the handoff
            p.unlink()
        restart = pdh.start_worker([*pdh.WORKER_ARGS, *kv, "--role", "prefill"],
                                   tmp_path / "p2.log",
                                   env=pdh.env(key_file))  # and the prefill worker's cache
        pw.stop()
        proxy.upstream = pdh.prefill_address(restart)
        before = pdh.scrape(dw.base_url)
        status, got = pdh.post(dw.base_url, pdh.body(user), pdh.signed(key_file, proxy.address))
        assert status == 200, got
        assert pdh.text_of(got) == pdh.text_of(ref)
        after = pdh.scrape(dw.base_url)
        store = f'{wire.M_PD_HANDOFFS}{{path="store"}}'
        assert after[store] == before[store] + 1
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_blocks[0] * 16
        restart.stop()
    finally:
        proxy.stop()
        dw.stop()
        if pw.proc.poll() is None:
            pw.stop()


def test_handoff_between_unlike_kv_layouts_is_refused(pdh, tmp_path, key_file, decode,
                                                      prefill) -> None:
    """A bfloat16 prefill worker's blocks are not a float32 decode worker's: the offer's
    namespace differs, the decode worker pulls nothing and answers as it would alone."""
    args = [a if a != "float32" else "bfloat16" for a in pdh.WORKER_ARGS]
    other = pdh.start_worker([*args, "--role", "prefill"], tmp_path / "bf16.log",
                             env=pdh.env(key_file))
    try:
        user = "Which sea borders Marseille?"
        want = pdh.reference(prefill, user)
        before = pdh.fallbacks(decode, "kv_mismatch")
        peer = f'{wire.M_PD_HANDOFFS}{{path="peer"}}'
        loaded = pdh.scrape(decode.base_url)[peer]
        status, got = pdh.post(decode.base_url, pdh.body(user),
                               pdh.signed(key_file, pdh.prefill_address(other)))
        assert status == 200, got
        assert pdh.text_of(got) == pdh.text_of(want)
        assert pdh.fallbacks(decode, "kv_mismatch") == before + 1
        assert pdh.scrape(decode.base_url)[peer] == loaded     # nothing was pulled
    finally:
        other.stop()
