"""The worker's OpenAI API with the real engine on the demo model, via the official client.

One `kvyard worker` process (conftest.py) serves the whole module (float32: greedy output is
deterministic, so streamed and non-streamed text can be compared exactly).
"""
from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvyard.common.models import DEMO_SERVED_NAME
from kvyard.common.wire import ENDPOINT_HEADER
from kvyard.workers.server.testing import WorkerProcess

MODEL = DEMO_SERVED_NAME
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def post(worker: WorkerProcess, path: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(worker.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, dict(r.headers), json.loads(r.read())


def scrape(worker: WorkerProcess) -> dict[str, float]:
    """Metric samples keyed by their full `name{labels}` text."""
    with urllib.request.urlopen(worker.base_url + "/metrics", timeout=10) as r:
        assert r.headers[ENDPOINT_HEADER] == f"127.0.0.1:{worker.port}"
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def sample(samples: dict[str, float], name: str) -> float:
    hits = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
    assert len(hits) == 1, f"{name}: {hits}"
    return hits[0]


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_streaming_and_streaming_agree(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                          temperature=0)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    u = full.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == u.completion_tokens


def test_completions_client_raw_http_and_token_ids_agree(client: openai.OpenAI,
                                                         worker: WorkerProcess) -> None:
    prompt = "The capital of France is"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    via_client = client.completions.create(**body)
    assert via_client.object == "text_completion" and via_client.choices[0].text
    status, headers, raw = post(worker, "/v1/completions", body)
    assert status == 200 and headers[ENDPOINT_HEADER] == f"127.0.0.1:{worker.port}"
    assert raw["choices"][0]["text"] == via_client.choices[0].text
    assert raw["usage"]["completion_tokens"] == via_client.usage.completion_tokens

    _, _, tok = post(worker, "/tokenize", {"prompt": prompt})
    assert tok["count"] == len(tok["tokens"]) == via_client.usage.prompt_tokens
    assert post(worker, "/detokenize", {"tokens": tok["tokens"]})[2] == {"prompt": prompt}
    with urllib.request.urlopen(worker.base_url + "/version", timeout=10) as r:
        assert json.loads(r.read())["version"]
    _, _, by_ids = post(worker, "/v1/completions", dict(body, prompt=tok["tokens"]))
    assert by_ids["choices"][0]["text"] == via_client.choices[0].text

    streamed = client.completions.create(**body, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == via_client.choices[0].text


def test_length_stop_and_seed(client: openai.OpenAI) -> None:
    exact = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert exact.usage.completion_tokens == 16 and exact.choices[0].finish_reason == "length"
    words = re.findall(r"\w{3,}", exact.choices[0].text)
    assert len(words) >= 2, exact.choices[0].text
    stop = words[1]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == exact.choices[0].text[:exact.choices[0].text.index(stop)]

    runs = [client.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=12,
                                      temperature=1.0, seed=7).choices[0].text
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_logprobs_in_both_shapes_streamed_and_not(client: openai.OpenAI,
                                                   worker: WorkerProcess) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6,
            "temperature": 0, "logprobs": 3, "extra_body": {"ignore_eos": True}}
    lp = client.completions.create(**body).choices[0].logprobs
    text = client.completions.create(**body).choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and 3 <= len(top) <= 4 and top[tok] == v == max(top.values())
    streamed = [c.choices[0].logprobs for c in client.completions.create(**body, stream=True)
                if c.choices[0].logprobs]
    assert [t for c in streamed for t in c.tokens] == lp.tokens
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob and bytes(e.bytes).decode() == e.token
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8,
                                                 temperature=0, logprobs=True, stream=True))
    got = [e for c in chunks if c.choices and c.choices[0].logprobs
           for e in c.choices[0].logprobs.content]
    assert [e.token for e in got] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in got)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == chat.choices[0].message.content


def test_echo_with_logprobs_scores_a_prompt_like_lm_eval(client: openai.OpenAI,
                                                         worker: WorkerProcess) -> None:
    """lm-eval-harness's loglikelihood request: echo + logprobs + max_tokens 1. The prompt's
    entries come first (the first with null logprob), then the generated token; scoring a
    continuation twice (the second time its blocks are cached) gives the same numbers."""
    _, _, ctx = post(worker, "/tokenize", {"prompt": "The capital of France is"})
    _, _, full = post(worker, "/tokenize", {"prompt": "The capital of France is Paris"})
    n = full["count"]
    body = {"model": MODEL, "prompt": full["tokens"], "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "echo": True}
    runs = [post(worker, "/v1/completions", body)[2] for _ in range(2)]
    lp = runs[0]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    assert runs[0]["choices"][0]["text"].startswith("".join(lp["tokens"][:n]))
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n + 1)]
    assert runs[1]["choices"][0]["logprobs"] == lp
    cont = lp["token_logprobs"][ctx["count"]:n]
    assert cont and sum(cont) < 0
    for tok, top in zip(lp["tokens"][1:n], lp["top_logprobs"][1:n]):
        assert tok in top and 1 <= len(top) <= 2
    # the same scores by streaming: the prompt first, in a chunk of its own
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True)]
    assert chunks[0].logprobs.token_logprobs == lp["token_logprobs"][:n]
    plain = post(worker, "/v1/completions", dict(body, logprobs=None))[2]["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == runs[0]["choices"][0]["text"]


def test_n_choices_streamed_and_not(client: openai.OpenAI, worker: WorkerProcess) -> None:
    """n choices: each its own sample (seed + index), usage counts the prompt once and
    every choice's tokens, streams interleave chunks tagged with each index."""
    body = dict(model=MODEL, prompt="Tell me a story", max_tokens=10, temperature=1.0, seed=11,
                n=3, extra_body={"ignore_eos": True})
    full = client.completions.create(**body)
    texts = [c.text for c in sorted(full.choices, key=lambda c: c.index)]
    assert [c.index for c in full.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert full.usage.completion_tokens == 30
    one = client.completions.create(**dict(body, n=1)).choices[0].text
    assert one == texts[0]                            # choice 0 keeps the request's seed
    again = client.completions.create(**body)
    assert [c.text for c in again.choices] == texts   # the whole answer is reproducible

    chunks = list(client.completions.create(**body, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert [streamed[i] for i in range(3)] == texts
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2] and chunks[-1].usage.completion_tokens == 30

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                          n=2, logprobs=True)
    assert len(chat.choices) == 2
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy twice
    assert all(len(c.logprobs.content) >= 1 for c in chat.choices)


def test_a_batch_of_prompts_gives_one_choice_per_prompt_and_sample(client: openai.OpenAI,
                                                                   worker: WorkerProcess) -> None:
    """OpenAI's batched completions (lm-eval-harness sends them): texts and token-id lists
    mixed, choice index = prompt * n + sample, usage sums each prompt once."""
    _, _, tok = post(worker, "/tokenize", {"prompt": "The capital of France is"})
    prompts = ["Once upon a time", tok["tokens"], "Hello"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
             for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == list(range(6))
    by_index = {c.index: c.text for c in batch.choices}
    for j, a in enumerate(alone):
        assert by_index[2 * j] == by_index[2 * j + 1] == a.choices[0].text
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    streamed = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=5,
                                              temperature=0, stream=True))
    text = {i: "".join(c.choices[0].text for c in streamed if c.choices[0].index == i)
            for i in range(3)}
    assert [text[i] for i in range(3)] == [a.choices[0].text for a in alone]


def test_vllm_prompt_logprobs(client: openai.OpenAI) -> None:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or the prompt token
    and the k most likely, each with logprob, rank and decoded_token; the numbers are
    those echo reports; chat puts them at the top level; streaming refuses them."""
    prompt = "The capital of France is Paris, and the capital of Italy is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    pl = out.choices[0].model_extra["prompt_logprobs"]
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                     echo=True, logprobs=1)
    lp = echo.choices[0].logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(pl) == n_prompt and pl[0] is None
    for i, entry in enumerate(pl[1:], start=1):
        ranked = sorted(entry.values(), key=lambda v: v["rank"])
        assert 2 <= len(entry) <= 3 and all(v["logprob"] <= 0 for v in entry.values())
        assert ranked[0]["rank"] == 1 and ranked[0]["logprob"] == max(v["logprob"] for v in entry.values())
        mine = [v for v in entry.values() if v["decoded_token"] == lp.tokens[i]]
        assert mine and abs(mine[-1]["logprob"] - lp.token_logprobs[i]) < 1e-4
        assert (mine[-1]["rank"] == 1) == (lp.top_logprobs[i][lp.tokens[i]] >= max(lp.top_logprobs[i].values()))
    assert any(v["rank"] > 2 for entry in pl[1:] for v in entry.values())  # ranks past the top k
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    cpl = chat.model_extra["prompt_logprobs"]
    assert len(cpl) == chat.usage.prompt_tokens and cpl[0] is None and all(len(e) == 1 for e in cpl[1:])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert e.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"prompt_logprobs": 21})


def test_n_samples_prefill_their_prompt_once(client: openai.OpenAI, worker: WorkerProcess,
                                             wait_until) -> None:
    """The samples after the first start once it has its first token, so they take the
    prompt's full blocks from the prefix cache instead of computing them side by side."""
    words = " ".join(f"item{i}" for i in range(60))           # a prompt no test used before
    _, _, tok = post(worker, "/tokenize", {"prompt": words})
    full_blocks = tok["count"] // 16 * 16
    assert full_blocks >= 32
    before = settled_scrape(worker, wait_until)
    out = client.completions.create(model=MODEL, prompt=words, max_tokens=2, temperature=0, n=3)
    assert len(out.choices) == 3
    after = settled_scrape(worker, wait_until)
    hits = sample(after, "vllm:prefix_cache_hits_total") - sample(before, "vllm:prefix_cache_hits_total")
    assert hits == 2 * full_blocks


def test_penalties_bias_and_min_tokens_are_honoured(client: openai.OpenAI,
                                                    worker: WorkerProcess) -> None:
    _, _, tok = post(worker, "/tokenize", {"prompt": " Paris"})
    paris = tok["tokens"][-1]
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={str(paris): 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [" Paris"] * 4
    base = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**base).choices[0].text
    assert client.completions.create(**base, frequency_penalty=2.0).choices[0].text != plain
    assert client.completions.create(**base, presence_penalty=0.0).choices[0].text == plain
    short = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=64, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    longer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=64, temperature=0,
        extra_body={"min_tokens": short.usage.completion_tokens + 5})
    assert longer.usage.completion_tokens >= short.usage.completion_tokens + 5


def settled_scrape(worker: WorkerProcess, wait_until) -> dict[str, float]:
    """A scrape whose histograms include every finished request: they are re-rendered at
    most once a second (cheap 50 ms scrapes), the outcome counter on every scrape."""
    def settled() -> dict[str, float] | None:
        m = scrape(worker)
        finished = sum(v for k, v in m.items() if k.startswith("vllm:request_success_total{"))
        return m if sample(m, "vllm:e2e_request_latency_seconds_count") == finished else None

    return wait_until(settled, timeout=10, what="histograms to catch up")


def test_metrics_names_and_counters_grow(client: openai.OpenAI, worker: WorkerProcess,
                                        wait_until) -> None:
    before = settled_scrape(worker, wait_until)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count",
                 "vllm:time_per_output_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert f'{name}{{model_name="{MODEL}"}}' in before, name
    info = [k for k in before if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and 'block_size="16"' in info[0] and before[info[0]] == 1.0
    assert re.search(r'num_gpu_blocks="[1-9]\d*"', info[0])

    done = client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True})
    after = settled_scrape(worker, wait_until)

    def grew(name: str) -> float:
        return sample(after, name) - sample(before, name)

    assert grew("vllm:generation_tokens_total") >= done.usage.completion_tokens == 5
    assert grew("vllm:prompt_tokens_total") >= done.usage.prompt_tokens
    assert grew("vllm:prefix_cache_queries_total") >= done.usage.prompt_tokens
    key = f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
    assert after[key] - before[key] == 1
    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    assert grew("vllm:time_per_output_token_seconds_count") == 1
    assert grew("vllm:inter_token_latency_seconds_count") == 4


def test_concurrent_requests_all_complete(client: openai.OpenAI, worker: WorkerProcess,
                                          wait_until) -> None:
    def one(i: int) -> int:
        if i % 2:
            chunks = client.completions.create(model=MODEL, prompt=f"List {i}:", max_tokens=10,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            return list(chunks)[-1].usage.completion_tokens
        return client.completions.create(model=MODEL, prompt=f"List {i}:", max_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True}
                                         ).usage.completion_tokens

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(4))) == [10] * 4
    wait_until(lambda: sample(scrape(worker), "vllm:num_requests_running") == 0, timeout=10,
               what="the engine to go idle")


def test_the_sdk_parses_our_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert nf.value.code == "model_not_found" and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as br:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, best_of=3)
    assert br.value.code == "unsupported_parameter" and br.value.param == "best_of"


def test_errors_carry_the_endpoint_header(worker: WorkerProcess) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(worker.base_url + "/no/such/route", timeout=10)
    assert e.value.code == 404
    assert e.value.headers[ENDPOINT_HEADER] == f"127.0.0.1:{worker.port}"
    assert json.loads(e.value.read())["error"]["code"] == "not_found"


def _open_raw(worker: WorkerProcess, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", worker.port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return s


@pytest.mark.parametrize("stream,n", [(True, 1), (False, 1), (True, 3), (False, 2)],
                         ids=["stream", "non-stream", "stream-n3", "non-stream-n2"])
def test_client_disconnect_frees_the_request(worker: WorkerProcess, wait_until,
                                             stream: bool, n: int) -> None:
    max_tokens = 800  # minutes of decoding at CPU speed: only an abort ends it in time
    before = scrape(worker)
    s = _open_raw(worker, {"model": MODEL, "prompt": "Write a long essay about the sea.",
                           "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                           "stream": stream, "n": n})
    try:
        if stream:  # the first data event proves generation is under way
            got = b""
            while b"data: " not in got:  # the socket's timeout bounds each read
                chunk = s.recv(65536)
                assert chunk, got
                got += chunk

        def busy() -> bool:
            m = scrape(worker)
            return (sample(m, "vllm:num_requests_running") == n
                    and sample(m, "vllm:kv_cache_usage_perc") > 0)

        wait_until(busy, timeout=60, what="the request to run")
    finally:
        s.close()

    def idle() -> dict[str, float] | None:
        m = scrape(worker)
        ok = (sample(m, "vllm:num_requests_running") == 0
              and sample(m, "vllm:num_requests_waiting") == 0
              and sample(m, "vllm:kv_cache_usage_perc") == 0)
        return m if ok else None

    after = wait_until(idle, timeout=20, what="the aborted request to free its blocks")
    generated = sample(after, "vllm:generation_tokens_total") - sample(
        before, "vllm:generation_tokens_total")
    assert generated < n * max_tokens
    key = f'vllm:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}'
    assert after[key] - before[key] == n
