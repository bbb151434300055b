"""The whole stack's error contract with real workers: every bad request in
the corpus gets a 4xx in OpenAI's shape with a string code (never a 5xx, which
OpenAI's SDKs would retry), through the gateway and at a worker directly, and
the stack serves normally afterwards."""
from __future__ import annotations

from kvyard.bench.bad_inputs import cases, run_corpus


def _bad(answers) -> list[str]:
    return [f"{a.case}: {a.status} {a.error}" for a in answers
            if not (400 <= a.status < 500 and a.error is not None)]


def test_corpus_has_one_case_per_name():
    names = [c.name for c in cases()]
    assert len(names) == len(set(names)) > 30


def test_bad_input_through_the_gateway_is_4xx_in_openai_shape(real_stack, h) -> None:
    assert _bad(run_corpus(real_stack.gateway_url)) == []
    assert h.request(real_stack.gateway_url, h.chat_body("still serving")).status == 200


def test_bad_input_at_a_worker_is_4xx_in_openai_shape(real_stack, h) -> None:
    worker = "http://" + real_stack.endpoints[0]
    assert _bad(run_corpus(worker)) == []
    assert h.request(worker, h.chat_body("still serving")).status == 200
