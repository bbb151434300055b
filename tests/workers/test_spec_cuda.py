"""Speculative decoding on CUDA (skipped without a GPU): verify steps replay CUDA graphs
(1 + k query tokens per row, drafted and plain rows right-aligned in one graph), and greedy
tokens equal the engine's without speculation and Hugging Face transformers' (float32)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from kvyard.common.models import ModelNotFound, resolve_model  # noqa: E402
from kvyard.workers.engine.api import SamplingParams  # noqa: E402
from kvyard.workers.engine.config import EngineConfig  # noqa: E402
from kvyard.workers.engine.llm import LLM  # noqa: E402
from kvyard.workers.engine.llm_engine import LLMEngine  # noqa: E402

NEW = 48
QUESTIONS = ["Repeat this code exactly:\ndef area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n"
             "    return 2 * (w + h)\n",
             "Quote this sentence twice: the river runs past the old mill and under the stone bridge.",
             "What is the capital of France?", "Write a short poem about the sea."]
MODES = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "policy": "always"},
         "draft": {"method": "draft_model", "model": "demo", "draft_layers": 24, "num_speculative_tokens": 3,
                   "policy": "always"}}


@pytest.fixture(scope="module")
def demo():
    from kvyard.common.tokenizer import load_tokenizer
    from kvyard.workers.model import load_model

    try:
        src = resolve_model("demo")
    except ModelNotFound:
        pytest.skip("the demo model is not installed")
    tok = load_tokenizer("demo")
    model, cfg = load_model(src, torch.float32, 2048, device="cuda")
    return model, cfg, [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_tokens(demo):
    from transformers import AutoModelForCausalLM

    from kvyard.common.models import demo_gguf_path

    p = demo_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).cuda().eval()
    out = []
    with torch.inference_mode():
        for ids in demo[2]:
            x = torch.tensor([ids], device="cuda")
            y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                            pad_token_id=hf.config.eos_token_id)
            out.append(y[0, len(ids):].tolist())
    return out


def _run(demo, spec, eager: bool):
    model, cfg, prompts = demo
    conf = EngineConfig(model="demo", dtype="float32", device="cuda", enforce_eager=eager, max_model_len=2048,
                        max_num_seqs=8, kv_cache_memory_bytes=256 << 20, speculative_config=spec)
    engine = LLMEngine(conf, model, cfg, None)
    replays = []
    vg = engine.runner.verify_graphs
    if vg is not None:
        run = vg.run_verify
        vg.run_verify = lambda *a: replays.append(1) or run(*a)
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW))
    return [o.token_ids for o in outs], engine, replays


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("eager", [False, True])
def test_greedy_with_speculation_equals_transformers_and_no_speculation(demo, hf_tokens, mode, eager):
    plain, _, _ = _run(demo, None, eager)
    got, engine, replays = _run(demo, MODES[mode], eager)
    assert got == plain
    assert got == hf_tokens
    st = engine.stats().spec_decode
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0
    assert (engine.runner.verify_graphs is None) == eager
    if not eager:
        assert replays, "no verify step ran as a CUDA graph"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random 4-layer Llama saved as an HF directory (what test_cuda_engine.py uses)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY)).float()
    d = tmp_path_factory.mktemp("tiny_spec")
    hf.save_pretrained(d, safe_serialization=True)
    return d, hf


TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.mark.parametrize("eager", [False, True])
def test_tiny_model_speculation_keeps_greedy_tokens(tiny_dir, eager):
    """Without the demo: a random 4-layer Llama, prompts that repeat a pattern (so n-gram
    lookup drafts), n-gram and a 2-layer draft of the model itself; tokens equal plain
    decoding's and transformers'."""
    from kvyard.workers.model import load_model

    d, hf = tiny_dir
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() * 4 for n in (3, 5, 8, 13)]
    hf = hf.cuda().eval()
    want = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device="cuda")
            y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                            pad_token_id=0)
            want.append(y[0, len(ids):].tolist())
    model, cfg = load_model(resolve_model(str(d)), torch.float32, 1024, device="cuda")
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

    def tokens(spec):
        conf = EngineConfig(model=str(d), dtype="float32", device="cuda", enforce_eager=eager, max_model_len=1024,
                            max_num_seqs=8, kv_cache_memory_bytes=64 << 20, speculative_config=spec)
        engine = LLMEngine(conf, model, cfg, None)
        return [o.token_ids for o in LLM(engine=engine).generate(prompts, params)], engine

    plain, _ = tokens(None)
    for spec in (MODES["ngram"], {**MODES["draft"], "model": str(d), "draft_layers": 2}):
        got, engine = tokens(spec)
        assert got == plain, spec["method"]
        assert all(g[:len(w)] == w for g, w in zip(got, want)), spec["method"]
        assert engine.stats().spec_decode.num_drafts > 0
        assert (engine.runner.verify_graphs is None) == eager
