"""ModelConfig: the one shape description both loaders produce and the model consumes.

Hugging Face `config.json` changed its RoPE keys between transformers 4
(`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`); GGUF spells the same
facts as `<arch>.*` metadata. Everything is normalised here so the model code
never sees where a checkpoint came from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type / GGUF architecture -> our family name. All share one decoder.
SUPPORTED = {"llama": "llama", "mistral": "llama", "smollm": "llama", "qwen2": "qwen2"}


@dataclass(slots=True)
class ModelConfig:
    architecture: str                 # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None         # None, or {"rope_type": "llama3"|"linear"|"freq_factors", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool              # q/k/v projections carry a bias (Qwen2)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _family(name: str) -> str:
    fam = SUPPORTED.get(name.lower())
    if fam is None:
        raise ValueError(f"unsupported architecture {name!r}; kvyard runs {sorted(SUPPORTED)}")
    return fam


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers-4 or transformers-5 keys."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    theta = d.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = scaling or params
    if scaling:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling.pop("rope_theta", None)
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
        elif kind not in ("llama3", "linear"):
            raise ValueError(f"unsupported rope scaling {kind!r}")
    return float(theta if theta is not None else 10000.0), scaling


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    fam = _family(d.get("model_type", ""))
    if fam == "qwen2" and d.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported")
    heads = d["num_attention_heads"]
    theta, scaling = _rope_from_hf(d)
    return ModelConfig(
        architecture=fam,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=fam == "qwen2" or bool(d.get("attention_bias", False)),
    )


def config_from_gguf(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """`shapes` are torch-order tensor shapes; the embedding's gives the vocab when metadata lacks it."""
    tensor_names = shapes.keys()
    arch = meta["general.architecture"]
    fam = _family(arch)

    def g(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    vocab = g("vocab_size") or shapes["token_embd.weight"][0]
    scaling = None
    kind = g("rope.scaling.type")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {kind!r}")
    # llama3-style scaling is baked into a `rope_freqs` tensor; the loader fills the factors.
    if "rope_freqs.weight" in tensor_names:
        scaling = {"rope_type": "freq_factors"}
    return ModelConfig(
        architecture=fam,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length", hidden // heads)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
    )
