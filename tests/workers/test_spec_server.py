"""`kvyard worker --speculative-config` over HTTP: greedy completions (plain and streamed)
are the tokens the engine gives without speculation, and /metrics carries vLLM's
speculative decoding counters."""
from __future__ import annotations

import json
import os
import urllib.request
from typing import Iterator

import openai
import pytest
import torch

from kvyard.common.models import DEMO_SERVED_NAME, resolve_model
from kvyard.common.tokenizer import load_tokenizer
from kvyard.workers.engine.api import SamplingParams
from kvyard.workers.engine.config import EngineConfig
from kvyard.workers.engine.llm import LLM
from kvyard.workers.engine.llm_engine import LLMEngine
from kvyard.workers.server.testing import WorkerProcess, start_worker

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10\n1, 2, 3, 4, 5, 6, 7, 8, 9, 10\n1, 2, 3,"
NEW = 32
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "policy": "always"}


@pytest.fixture(scope="module")
def spec_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("spec") / "worker.log"
    env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
    w = start_worker(["--model", "demo", "--dtype", "float32", "--max-model-len", "1024",
                      "--kv-cache-memory-bytes", "32MiB", "--num-threads", "1",
                      "--speculative-config", json.dumps(SPEC)], log, env=env)
    yield w
    assert w.stop() == 0, f"worker did not shut down cleanly:\n{w.log_tail()}"


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], str]:
    """The prompt's greedy tokens and text from the engine without speculation."""
    from kvyard.workers.model import load_model

    tok = load_tokenizer("demo")
    model, cfg = load_model(resolve_model("demo"), torch.float32)
    llm = LLM(engine=LLMEngine(EngineConfig(dtype="float32", kv_cache_memory_bytes=32 << 20), model, cfg, tok))
    out = llm.generate([tok.encode(PROMPT)], SamplingParams(temperature=0.0, max_tokens=NEW))[0]
    return out.token_ids, out.text


def test_completions_plain_and_streamed_equal_no_speculation(spec_worker, reference):
    client = openai.OpenAI(base_url=spec_worker.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    full = client.completions.create(model=DEMO_SERVED_NAME, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                     logprobs=1)
    assert full.choices[0].text == reference[1]
    assert len(full.choices[0].logprobs.tokens) == len(reference[0])
    assert full.usage.completion_tokens == len(reference[0])
    chunks = client.completions.create(model=DEMO_SERVED_NAME, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == reference[1]
    with urllib.request.urlopen(spec_worker.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {line.rsplit(" ", 1)[0].split("{")[0] + ("{pos0}" if 'position="0"' in line else ""):
              float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:spec_decode")}
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert values["vllm:spec_decode_num_draft_tokens_total"] >= values["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert values["vllm:spec_decode_num_accepted_tokens_per_pos_total{pos0}"] > 0
