"""Bad input through Envoy gets a prompt 4xx, never a hang or a 5xx."""
from __future__ import annotations


def test_non_json_body_is_rejected(stack, h) -> None:
    r = h.request(stack.gateway_url, b"this is { not json")
    assert 400 <= r.status < 500, (r.status, r.body)
    assert r.seconds < 5


def test_json_without_messages_is_rejected(stack, h) -> None:
    for body in ({"model": "x"}, {}, []):
        r = h.request(stack.gateway_url, body)
        assert 400 <= r.status < 500, (body, r.status, r.body)


def test_request_without_model_is_served_as_the_default_model(stack, h) -> None:
    # vLLM's behaviour, the same through the gateway as at a worker directly.
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert h.request(stack.gateway_url, body).status == 200
    assert h.request("http://" + stack.endpoints[0], body).status == 200


def test_body_over_the_limit_is_413(stack, h) -> None:
    big = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * (5 << 20) + b'"}]}'
    r = h.request(stack.gateway_url, big, timeout=30)
    assert r.status == 413


def test_invalid_utf8_is_rejected(stack, h) -> None:
    body = b'{"model": "x", "messages": [{"role": "user", "content": "\xff\xfe bad"}]}'
    r = h.request(stack.gateway_url, body)
    assert 400 <= r.status < 500, (r.status, r.body)


def test_stack_still_serves_after_bad_input(stack, h) -> None:
    r = h.request(stack.gateway_url, h.chat_body("still alive"))
    assert r.status == 200
    assert r.endpoint in stack.endpoints
