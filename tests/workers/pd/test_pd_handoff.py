"""P/D handoffs between real workers on the demo model: roles are published, the
handoff's output equals the colocated output over either transport, pulled while the
prefill computes or after it, and with the answer streamed to the client."""
from __future__ import annotations

import json
import urllib.request

import pytest

from kvyard.common import wire


def test_roles_are_published(pdh, prefill, decode) -> None:
    for w, role in ((prefill, "prefill"), (decode, "decode")):
        with urllib.request.urlopen(w.base_url + "/health", timeout=10) as r:
            assert json.loads(r.read())["role"] == role
        assert pdh.scrape(w.base_url)[f'{wire.M_WORKER_INFO}{{role="{role}"}}'] == 1.0


@pytest.mark.parametrize("transport,worker", [("shm", "decode"), ("tcp", "decode_tcp"),
                                              ("shm", "decode_classic")])
def test_handoff_gives_the_colocated_output(pdh, prefill, key_file, wait_until, request,
                                            transport, worker) -> None:
    """Over the same-host memfd (the default decode worker on this host) and over TCP
    (a decode worker told to use TCP only, as one on another host), streamed while the
    prefill computes; and pulled from the offer after it (--no-pd-stream)."""
    decode = request.getfixturevalue(worker)
    streamed = worker != "decode_classic"
    user = f"Which river flows through Paris? ({worker})"
    want = pdh.reference(prefill, user)
    before = pdh.scrape(decode.base_url)
    status, got = pdh.post(decode.base_url, pdh.body(user),
                           pdh.signed(key_file, pdh.prefill_address(prefill)))
    assert status == 200, got
    assert pdh.text_of(got) == pdh.text_of(want)
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    after = pdh.scrape(decode.base_url)
    peer = f'{wire.M_PD_HANDOFFS}{{path="peer"}}'
    assert after[peer] == before[peer] + 1
    for t in ("shm", "tcp"):
        key = f'{wire.M_PD_TRANSFERS}{{transport="{t}"}}'
        assert after[key] == before[key] + (t == transport)
    blocks = (want["usage"]["prompt_tokens"] - 1) // 16
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 16
    assert after[wire.M_PD_HANDOFF_BYTES] > before[wire.M_PD_HANDOFF_BYTES]
    streamed_blocks = sum(after[f'{wire.M_PD_STREAMED_BLOCKS}{{when="{w}"}}']
                          - before[f'{wire.M_PD_STREAMED_BLOCKS}{{when="{w}"}}']
                          for w in ("during_prefill", "after_prefill"))
    assert streamed_blocks == (blocks if streamed else 0)
    # each phase of this kind of handoff was timed once, the others not at all
    timed = ("stream_tail", "insert") if streamed else ("claim", "transfer", "verify",
                                                        "insert")
    for phase in ("claim", "transfer", "verify", "insert", "stream_tail"):
        key = f'{wire.M_PD_PHASE_SECONDS}_count{{phase="{phase}"}}'
        assert after[key] == before[key] + (phase in timed), phase
    leg = f'{wire.M_PD_PHASE_SECONDS}_count{{phase="prefill_leg"}}'  # streamed: may end later
    wait_until(lambda: pdh.scrape(decode.base_url)[leg] == before[leg] + 1, timeout=30,
               what="the prefill leg timed")
    # the prefill worker gave its held blocks back once they were pulled
    wait_until(lambda: pdh.kv_usage(prefill) == 0.0, timeout=60, what="held blocks freed")


def test_streamed_handoff_streams(pdh, prefill, decode, key_file) -> None:
    want = pdh.text_of(pdh.reference(prefill, "Name a mountain in the Alps."))
    req = urllib.request.Request(
        decode.base_url + "/v1/chat/completions",
        json.dumps(pdh.body("Name a mountain in the Alps.", stream=True)).encode(),
        {"Content-Type": "application/json",
         **pdh.signed(key_file, pdh.prefill_address(prefill))})
    parts = []
    with urllib.request.urlopen(req, timeout=180) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: {"):
                ch = json.loads(line[6:])["choices"]
                if ch and ch[0]["delta"].get("content"):
                    parts.append(ch[0]["delta"]["content"])
    assert len(parts) >= 2 and "".join(parts) == want
