"""The same path with real `kvyard worker` processes on the demo model, driven
by the official openai client as a user would (one worker: loading is slow on CPU)."""
from __future__ import annotations

from kvyard.common.models import DEMO_SERVED_NAME


def test_openai_client_through_the_gateway(real_stack) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=real_stack.gateway_url + "/v1", api_key="x", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model=DEMO_SERVED_NAME, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Say hello."}])
    assert raw.headers["x-kvyard-endpoint"] == real_stack.endpoints[0]
    out = raw.parse()
    assert out.choices[0].message.content
    assert out.usage.completion_tokens >= 1

    stream = client.chat.completions.create(
        model=DEMO_SERVED_NAME, max_tokens=8, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Say hello."}])
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    # Several chunks: the answer streamed through Envoy rather than arriving whole.
    assert len([c for c in chunks if c]) >= 2 and "".join(chunks).strip()
