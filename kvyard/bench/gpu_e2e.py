"""`kvyard bench gpu --parts hf`: kvyard's engine against HF transformers' `generate`, end to end.

Same GPU, same model, same run: a Llama-3-8B-shape HF directory with random bf16 weights
(written by transformers' own `save_pretrained`, read back by kvyard's loader), greedy,
equal-length prompts so HF needs no padding. Each side is warmed up first (Triton and
cuBLAS pick their kernels), then timed end to end: prompt in, every new token out.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from typing import Any


def _hf_model(torch, layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def hf_generate_ratio(torch, args: argparse.Namespace) -> dict[str, Any]:
    from kvyard.common.models import resolve_model
    from kvyard.workers.engine.api import SamplingParams
    from kvyard.workers.engine.config import EngineConfig
    from kvyard.workers.engine.llm import LLM
    from kvyard.workers.engine.llm_engine import LLMEngine
    from kvyard.workers.model import load_model

    prompt_len, new = args.e2e_prompt, args.e2e_new
    out: dict[str, Any] = {"prompt_tokens": prompt_len, "new_tokens": new, "layers": args.layers, "batches": {}}
    d = tempfile.mkdtemp(prefix="kvyard-8b-", dir=args.scratch)
    try:
        t0 = time.perf_counter()
        hf = _hf_model(torch, args.layers)
        hf.save_pretrained(d, safe_serialization=True)
        out["hf_dir_write_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model, cfg = load_model(resolve_model(d), torch.bfloat16, 4096, device="cuda")
        out["kvyard_load_s"] = time.perf_counter() - t0
        batches = [int(b) for b in args.e2e_batches.split(",") if b]
        conf = EngineConfig(model=d, dtype="bfloat16", device="cuda", max_model_len=4096,
                            max_num_seqs=max(batches), kv_cache_memory_bytes=8 << 30,
                            max_num_batched_tokens=max(1024, prompt_len * max(batches)))
        t0 = time.perf_counter()
        llm = LLM(engine=LLMEngine(conf, model, cfg, None))
        out["kvyard_graph_capture_s"] = time.perf_counter() - t0
        g = torch.Generator().manual_seed(0)
        for B in batches:
            prompts = torch.randint(3, 128000, (B, prompt_len), generator=g)
            params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
            x = prompts.cuda()

            def ours() -> None:
                outs = llm.generate(prompts.tolist(), params)
                assert all(len(o.token_ids) == new for o in outs)

            def theirs() -> None:
                y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new,
                                min_new_tokens=new, pad_token_id=0)
                assert y.shape[1] == prompt_len + new
                torch.cuda.synchronize()

            with torch.inference_mode():
                ours()
                theirs()
                t_ours, t_hf = [], []
                for _ in range(args.e2e_rounds):  # alternate, so drift hits both alike
                    for fn, sink in ((ours, t_ours), (theirs, t_hf)):
                        t0 = time.perf_counter()
                        fn()
                        sink.append(time.perf_counter() - t0)
            ko, kh = statistics.median(t_ours), statistics.median(t_hf)
            out["batches"][str(B)] = dict(kvyard_s=ko, hf_s=kh, kvyard_tok_s=B * new / ko, hf_tok_s=B * new / kh,
                                          ratio=kh / ko, kvyard_spread_s=[min(t_ours), max(t_ours)],
                                          hf_spread_s=[min(t_hf), max(t_hf)])
        del llm, model, hf
        torch.cuda.empty_cache()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out
