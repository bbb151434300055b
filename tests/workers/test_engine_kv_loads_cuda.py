"""kvstore loads off the engine thread with the engine on CUDA (skipped without a GPU):
the loader copies on a stream of its own (DRAM hits from pinned frames in place, SSD
hits through the staging buffers) while CUDA-graph decode steps of another stream run,
and greedy tokens equal those computed without kvstore."""
from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from kvyard.common.models import resolve_model  # noqa: E402
from kvyard.common.tokenizer import load_tokenizer  # noqa: E402
from kvyard.kvstore import StoreConfig  # noqa: E402
from kvyard.workers.engine.api import SamplingParams  # noqa: E402
from kvyard.workers.engine.config import EngineConfig  # noqa: E402
from kvyard.workers.engine.llm import LLM  # noqa: E402
from kvyard.workers.engine.llm_engine import LLMEngine  # noqa: E402
from kvyard.workers.engine.sequence import SeqStatus  # noqa: E402
from kvyard.workers.kvconnector import StoreConnector  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
IDENT = "SmolLM2-135M-Instruct@0123456789abcdef"


@pytest.fixture(scope="module")
def loaded():
    from kvyard.workers.model import load_model

    model, cfg = load_model(resolve_model("demo"), torch.float32, 2048, device="cuda")
    return model, cfg, load_tokenizer("demo")


def make(loaded, connector=None) -> LLMEngine:
    model, cfg, tok = loaded
    conf = EngineConfig(dtype="float32", device="cuda", max_model_len=2048, max_num_seqs=8,
                        kv_cache_memory_bytes=256 << 20, kv_connector=connector)
    return LLMEngine(conf, model, cfg, tok)


class Gated(StoreConnector):
    def __init__(self, cfg, store=None) -> None:
        super().__init__(cfg, IDENT, store=store)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def load(self, block_hashes, block_ids) -> int:
        if not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(60)
        return super().load(block_hashes, block_ids)


@pytest.mark.parametrize("tier", ["dram", "ssd"])
def test_cuda_hit_loads_beside_decoding_and_gives_the_same_tokens(loaded, tmp_path, tier):
    tok = loaded[2]
    p = tok.encode("The history of the printing press begins in " * 60, add_special_tokens=False)
    q = tok.encode("List the planets of the solar system:", add_special_tokens=False)
    want_p, want_q = [o.token_ids for o in LLM(engine=make(loaded)).generate([p, q], [GREEDY, LONG])]
    cfg = StoreConfig(dram_bytes=1 << 28, ssd_dir=str(tmp_path), ssd_bytes=1 << 28)
    if tier == "dram":
        # the connector's own saves, dropped from the local prefix cache: its DRAM hits
        # are copied to the GPU from its pinned frames in place
        conn = Gated(cfg)
        eng = make(loaded, conn)
        assert LLM(engine=eng).generate([p], GREEDY)[0].token_ids == want_p
        eng.block_manager.reset_prefix_cache()
    else:
        # another engine's saves, read back from the directory through the staging buffers
        first = Gated(cfg)
        assert LLM(engine=make(loaded, first)).generate([p], GREEDY)[0].token_ids == want_p
        assert first.store.flush()
        first.close()
        conn = Gated(StoreConfig(ssd_dir=str(tmp_path), ssd_bytes=1 << 28))
        eng = make(loaded, conn)
    toks: dict[str, list[int]] = {"p": [], "q": []}
    cached = {}

    def step() -> None:
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
    eng.add_request("q", q, LONG)
    while len(toks["q"]) < 2:
        step()
    conn.gate.clear()
    eng.add_request("p", p, GREEDY)
    step()
    assert conn.entered.wait(30)
    assert eng.scheduler.requests["p"].status is SeqStatus.WAITING_FOR_KV_LOAD
    n = len(toks["q"])
    for _ in range(5):
        step()
    assert len(toks["q"]) == n + 5
    conn.gate.set()
    while eng.has_unfinished_requests():
        step()
    assert toks["p"] == want_p and toks["q"] == want_q
    assert cached["p"] == (len(p) - 1) // 16 * 16
    if tier == "dram":
        assert conn.direct_blocks > 0
    else:
        assert conn.store.stats()["ssd"]["hits"] > 0
    conn.close()
