"""Streamed handoffs between real workers: a prefill worker computing a long prompt in
small chunks sends each chunk's blocks as it completes, so the decode worker has most
of the KV when the prefill ends; the output is the colocated output. A stream damaged
on purpose or cut by a dying prefill worker ends in a fallback with the same output."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvyard.common import wire

STORY = ("Tell me how the Rhine runs from its sources in the Alps, past Basel, Strasbourg, "
         "Mainz, Koblenz, Cologne and Duisburg, to the North Sea, and which rivers join it. ")


def _user(tag: str) -> str:
    """Unlike any other test's prompt from its first user token on (nothing but the
    system prompt is in a prefix cache already)."""
    return f"({tag}) {STORY * 12}"


def _fallbacks(pdh, w) -> float:
    return sum(v for k, v in pdh.scrape(w.base_url).items()
               if k.startswith(wire.M_PD_FALLBACKS + "{"))


def _streamed(pdh, w, when: str) -> float:
    return pdh.counter(w, wire.M_PD_STREAMED_BLOCKS, when=when)


@pytest.mark.parametrize("worker,transport", [("decode", "shm"), ("decode_tcp", "tcp")])
def test_blocks_stream_while_the_prefill_computes(pdh, prefill, prefill_chunked, key_file,
                                                  request, wait_until, worker,
                                                  transport) -> None:
    decode = request.getfixturevalue(worker)
    user = _user(worker)
    want = pdh.reference(prefill, user)   # computed in one chunk, elsewhere
    blocks = (want["usage"]["prompt_tokens"] - 1) // 16
    assert blocks >= 20                   # many 32-token chunks: many steps to stream over
    before = pdh.scrape(decode.base_url)
    status, got = pdh.post(decode.base_url, pdh.body(user),
                           pdh.signed(key_file, pdh.prefill_address(prefill_chunked)))
    assert status == 200, got
    assert pdh.text_of(got) == pdh.text_of(want)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 16
    after = pdh.scrape(decode.base_url)
    key = f'{wire.M_PD_TRANSFERS}{{transport="{transport}"}}'
    assert after[key] == before[key] + 1
    during = f'{wire.M_PD_STREAMED_BLOCKS}{{when="during_prefill"}}'
    late = f'{wire.M_PD_STREAMED_BLOCKS}{{when="after_prefill"}}'
    early = after[during] - before[during]
    assert early > 0, "no block arrived before the prefill ended"
    assert early + after[late] - before[late] == blocks
    wait_until(lambda: pdh.kv_usage(prefill_chunked) == 0.0, timeout=60,
               what="held blocks freed")


@pytest.mark.parametrize("mode,reason", [("corrupt", "transfer_corrupt"),
                                         ("truncate", "transfer_truncated")])
def test_a_damaged_stream_falls_back_to_the_same_output(pdh, prefill, prefill_chunked,
                                                       decode, key_file, mode, reason) -> None:
    user = _user(mode)
    want = pdh.reference(prefill, user)
    proxy = pdh.PDProxy(pdh.prefill_address(prefill_chunked), mode, stream=True).start()
    try:
        before = pdh.fallbacks(decode, reason)
        streamed = _streamed(pdh, decode, "during_prefill")
        status, got = pdh.post(decode.base_url, pdh.body(user),
                               pdh.signed(key_file, proxy.address))
        assert status == 200, got
        assert pdh.text_of(got) == pdh.text_of(want)
        assert proxy.legs == 1 and proxy.transfers == 1
        assert pdh.fallbacks(decode, reason) == before + 1
        assert _streamed(pdh, decode, "during_prefill") == streamed   # nothing was loaded
    finally:
        proxy.stop()


def test_prefill_worker_killed_mid_stream(pdh, tmp_path, key_file, decode, prefill) -> None:
    doomed = pdh.start_worker([*pdh.WORKER_ARGS, "--role", "prefill",
                               "--max-num-batched-tokens", "32"], tmp_path / "doomed.log",
                              env=pdh.env(key_file))
    proxy = pdh.PDProxy(pdh.prefill_address(doomed), "pause", stream=True).start()
    user = _user("killed")
    want = pdh.reference(prefill, user)
    try:
        before = _fallbacks(pdh, decode)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(pdh.post, decode.base_url, pdh.body(user),
                              pdh.signed(key_file, proxy.address))
            assert proxy.paused.wait(180), "the stream never started"
            doomed.proc.kill()
            doomed.proc.wait(30)
            proxy.resume.set()
            status, got = fut.result(timeout=180)
        assert status == 200, got
        assert pdh.text_of(got) == pdh.text_of(want)
        # the leg or the stream noticed first (prefill_error, transfer_truncated): one fallback
        assert _fallbacks(pdh, decode) == before + 1
    finally:
        proxy.stop()
        if doomed.proc.poll() is None:
            doomed.proc.kill()
