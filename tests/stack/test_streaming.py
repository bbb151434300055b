"""Envoy must pass a streamed answer through as it is generated, not buffer it."""
from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit


def test_chunks_arrive_while_the_worker_is_still_generating(own_stack) -> None:
    # 10 chunks, 0.2 s apart: a buffering proxy would deliver nothing for ~2 s.
    state = own_stack(1, ["--tokens", "10", "--token-delay", "0.2"])
    u = urlsplit(state.gateway_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    body = {"model": "SmolLM2-135M-Instruct", "stream": True,
            "messages": [{"role": "user", "content": "stream please"}]}
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    arrivals: list[float] = []
    events: list[str] = []
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            arrivals.append(time.monotonic() - t0)
            events.append(line[6:].strip().decode())
    conn.close()
    assert events[-1] == "[DONE]"
    assert len(events) == 12  # 10 content chunks, the finish chunk, [DONE]
    assert arrivals[0] < 1.0, arrivals  # first chunk long before generation ends
    assert arrivals[-1] - arrivals[0] > 1.5, arrivals  # spread out, as generated
