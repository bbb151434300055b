"""Request parsing and prompt hashing with the demo model's real tokenizer."""
from __future__ import annotations

import json
import random

import pytest

from kvyard.common.hashing import block_hashes, seed_for
from kvyard.epp.prompt import PromptHasher, split_chunks
from kvyard.epp.request import Rejection, parse_request


@pytest.fixture(scope="module")
def tok():
    from kvyard.common.tokenizer import load_tokenizer
    return load_tokenizer("demo")


def _text(rng: random.Random, n: int) -> str:
    words = ("the quick brown fox jumps over lazy dogs. Hello, world! 1234 x=y+3; café naïve "
             "— «quoted» def f(x):\n    return x\n\n\n  indented it's we'll").split(" ")
    return " ".join(rng.choice(words) for _ in range(n)).replace("  ", "\n")


def test_chunked_tokenization_equals_whole_text(tok):
    rng = random.Random(0)
    for _ in range(30):
        text = _text(rng, rng.randint(50, 2000))
        chunks = split_chunks(text, rng.choice([64, 512, 2048]))
        assert "".join(chunks) == text
        assert [i for c in chunks for i in tok.encode(c)] == tok.encode(text)


def test_hashes_match_common_hashing_of_the_chat_template(tok):
    from kvyard.common.tokenizer import ChatTemplateError
    h = PromptHasher(block_size=16, chunk_chars=256)
    h.set_tokenizer(tok, ChatTemplateError)
    msgs = [{"role": "user", "content": _text(random.Random(1), 400)}]
    req = parse_request(json.dumps({"model": "m", "messages": msgs}).encode(),
                        "/v1/chat/completions", {}, ["m"])
    for _ in range(2):  # second time from the chunk cache
        hashes, n = h.hashes(req)
        ids = tok.encode_chat(msgs)
        assert n == len(ids)
        assert hashes == block_hashes(ids, 16, seed=seed_for("m"))


def test_shared_prefix_gives_shared_leading_hashes(tok):
    h = PromptHasher(block_size=16, chunk_chars=128)
    h.set_tokenizer(tok, None)
    system = _text(random.Random(2), 300)

    def hashes(q: str) -> list[int]:
        body = {"model": "m", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": q}]}
        return h.hashes(parse_request(json.dumps(body).encode(), "/v1/chat/completions", {},
                                      None))[0]
    a, b = hashes("what is a fox? " * 20), hashes("why are dogs lazy? " * 20)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common >= len(tok.encode(system)) // 16 - 1
    assert len(a) > common + 5  # and the questions do differ


def test_completions_prompt_forms_and_bad_input():
    h = PromptHasher(block_size=4)
    ids = parse_request(json.dumps({"model": "m", "prompt": list(range(16))}).encode(),
                        "/v1/completions", {}, None)
    assert h.hashes(ids) == (block_hashes(list(range(16)), 4, seed=seed_for("m/bytes")), 16)
    text = parse_request(b'{"model": "m", "prompt": ["abcd" , "x"]}', "/v1/completions", {}, None)
    assert h.hashes(text)[1] == 1  # byte-quad pseudo tokens of "abcd"
    bad = parse_request(b'{"model": "m", "prompt": [1, -2]}', "/v1/completions", {}, None)
    with pytest.raises(Rejection) as e:
        h.hashes(bad)
    assert e.value.status == 400


def test_bad_chat_messages_are_400(tok):
    from kvyard.common.tokenizer import ChatTemplateError
    h = PromptHasher()
    h.set_tokenizer(tok, ChatTemplateError)
    with pytest.raises(Rejection) as e:  # refused before any templating
        parse_request(b'{"model": "m", "messages": [{"content": "no role"}]}',
                      "/v1/chat/completions", {}, None)
    assert e.value.status == 400 and e.value.param == "messages[0].role"
    req = parse_request(b'{"model": "m", "messages": [{"role": "user", "content": {"a": 1}}]}',
                        "/v1/chat/completions", {}, None)
    try:
        h.hashes(req)
    except Rejection as e:
        assert e.status == 400
    else:  # the template tolerated it: then it must at least have hashed something
        assert h.hashes(req)[1] > 0


def test_priority_from_objective_header():
    body = b'{"model": "m", "prompt": "x"}'
    p = parse_request(body, "/v1/completions", {"x-gateway-inference-objective": "batch"}, None,
                      {"batch": -1})
    assert p.priority == -1
    p = parse_request(body, "/v1/completions", {"x-gateway-inference-objective": "-3"}, None)
    assert p.priority == -3
    assert parse_request(body, "/v1/completions", {}, None).priority == 0


def test_lazy_prompt_tokenizes_only_as_far_as_asked(tok):
    h = PromptHasher(block_size=16, chunk_chars=256)
    h.set_tokenizer(tok, None)
    text = _text(random.Random(3), 3000)
    req = parse_request(json.dumps({"model": "m", "prompt": text}).encode(), "/v1/completions",
                        {}, None)
    p = h.prompt(req)
    assert len(split_chunks(p.text, 256)) > 10
    assert p.get(0) is not None
    assert p.tokens < len(tok.encode(text)) // 5  # only the first chunk(s) so far
    est = p.estimated_blocks()
    full = p.finish()
    assert full == block_hashes(tok.encode(text), 16, seed=seed_for("m"))
    assert 0.7 * len(full) < est < 1.3 * len(full)
    assert p.get(len(full)) is None


async def test_deferred_hashing_teaches_the_index_through_the_server(fake_vllm, epp, xp):
    ws = [await fake_vllm() for _ in range(3)]
    app = await epp(ws, model="demo", served_model_names=[], seed=5)
    await xp.wait_for(app.is_ready, timeout=30, what="tokenizer and endpoints")
    assert app.director.hasher.mode == "tokens"
    doc = _text(random.Random(4), 4000)

    async def send(question: str) -> str:
        body = {"model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": doc + question}]}
        r = await xp.exchange(app.ports["ext_proc"], [xp.headers_msg(xp.chat_headers()),
                                                      xp.body_msg(json.dumps(body).encode())])
        return xp.set_headers(r[0])["x-gateway-destination-endpoint"]

    first = await send(" first?")
    ps = app.director.scheduler.prefix_scorer
    await xp.wait_for(lambda: app.finisher.backlog == 0 and ps.index.size(first) > 50,
                      what="index taught")
    for q in (" second?", " third?"):
        assert await send(q) == first
    matched = app.metrics.registry.get_sample_value("kvyard_epp_prefix_matched_blocks_total")
    assert matched > 100
