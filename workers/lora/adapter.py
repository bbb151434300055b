"""PEFT adapters (`adapter_config.json` + `adapter_model.safetensors`) read into the
engine's fused projections.

The engine multiplies q/k/v as one [q + 2 kv, H] matrix and gate/up as one [2 I, H]
(loader.py), so an adapter's per-module pairs are laid out per *fused* projection:
slice j of a projection owns rows [j * rank, (j + 1) * rank) of the stacked A and the
output columns of its module in B. One shrink (x A^T) and one expand (t B^T) per
projection then give every module's delta at once. PEFT's scaling (lora_alpha / r,
or / sqrt(r) with rsLoRA, per module with rank_pattern / alpha_pattern) is folded
into B.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# fused projection -> its modules in slice order
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULE_PROJ = {m: (p, j) for p, ms in PROJECTIONS.items() for j, m in enumerate(ms)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served here: the message says why."""


def projection_shapes(cfg) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """proj -> (input features, [(first output column, width) per slice])."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"qkv": (h, [(0, q), (q, kv), (q + kv, kv)]), "o": (q, [(0, h)]),
            "gate_up": (h, [(0, i), (i, i)]), "down": (i, [(0, h)])}


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter's weights in host memory (float32), per layer and fused projection:
    `a[layer][proj]` [slices * rank, in] and `b[layer][proj]` [out, slices * rank],
    scaling folded into b, zeros for modules the adapter leaves alone."""

    name: str
    path: str
    rank: int                                   # the largest module rank
    projections: frozenset[str]                 # fused projections it changes
    a: list[dict[str, torch.Tensor]] = field(default_factory=list)
    b: list[dict[str, torch.Tensor]] = field(default_factory=list)
    base_model_name: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in (*self.a, *self.b) for t in layer.values())


def _read_config(path: Path) -> dict:
    f = path / CONFIG_FILE
    if not f.is_file():
        raise LoRAError(f"No adapter found for {path}: no {CONFIG_FILE}")
    try:
        conf = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"{f}: unreadable: {e}") from None
    if not isinstance(conf, dict):
        raise LoRAError(f"{f}: not a JSON object")
    if conf.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{f}: peft_type {conf.get('peft_type')!r} is not LORA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if conf.get(key) == bad:
            raise LoRAError(f"{f}: {key} is not supported")
    if conf.get("bias", "none") != "none":
        raise LoRAError(f"{f}: bias {conf.get('bias')!r} is not supported (only 'none')")
    if conf.get("modules_to_save"):
        raise LoRAError(f"{f}: modules_to_save {conf['modules_to_save']} is not supported")
    if conf.get("layers_to_transform") is not None:
        raise LoRAError(f"{f}: layers_to_transform is not supported")
    return conf


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHTS_FILES:
        f = path / name
        if f.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                try:
                    return load_file(str(f))
                except Exception as e:  # noqa: BLE001 - a corrupt file is the user's error
                    raise LoRAError(f"{f}: unreadable: {e}") from None
            return torch.load(str(f), map_location="cpu", weights_only=True)
    raise LoRAError(f"No adapter found for {path}: no {' or '.join(WEIGHTS_FILES)}")


def _pattern_value(pattern: dict, module_key: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name's suffix or a regex."""
    for key, value in (pattern or {}).items():
        if re.fullmatch(f".*\\.{key}$", module_key) or module_key.endswith(key):
            return value
    return default


def load_adapter(path: str | Path, name: str, cfg, max_rank: int,
                 base_model_name: str | None = None) -> LoRAAdapter:
    """Read and validate an adapter for a model of config `cfg` (workers.model.ModelConfig)."""
    p = Path(path)
    if not p.is_dir():
        raise LoRAError(f"No adapter found for {path}")
    conf = _read_config(p)
    tensors = _read_weights(p)
    shapes = projection_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(f"{name}: unsupported weight {key!r} (LoRA on q/k/v/o and gate/up/down only)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULE_PROJ:
            raise LoRAError(f"{name}: unsupported target module {module!r}")
        if layer >= cfg.num_layers:
            raise LoRAError(f"{name}: layer {layer} but the model has {cfg.num_layers}")
        pairs.setdefault((layer, module), {})[ab] = t.to(torch.float32)
    if not pairs:
        raise LoRAError(f"{name}: no LoRA weights in {p}")
    ranks = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{name}: layer {layer} {module} lacks lora_{'B' if 'A' in ab else 'A'}")
        proj, j = MODULE_PROJ[module]
        fan_in, slices = shapes[proj]
        width = slices[j][1]
        r = ab["A"].shape[0]
        if ab["A"].shape != (r, fan_in) or ab["B"].shape != (width, r):
            raise LoRAError(f"{name}: layer {layer} {module}: A {tuple(ab['A'].shape)} / B "
                            f"{tuple(ab['B'].shape)} do not fit the model ([r, {fan_in}] / [{width}, r])")
        if r > max_rank:
            raise LoRAError(f"LoRA rank {r} is greater than max_lora_rank {max_rank}.")
        ranks[(layer, module)] = r
    rank = max(ranks.values())
    projs = frozenset(MODULE_PROJ[mod][0] for _, mod in pairs)
    adapter = LoRAAdapter(name, str(p), rank, projs, base_model_name=base_model_name)
    alpha0, rs = conf.get("lora_alpha", conf.get("r", rank)), bool(conf.get("use_rslora"))
    for layer in range(cfg.num_layers):
        a_l: dict[str, torch.Tensor] = {}
        b_l: dict[str, torch.Tensor] = {}
        for proj in projs:
            fan_in, slices = shapes[proj]
            out = slices[-1][0] + slices[-1][1]
            a = torch.zeros(len(slices) * rank, fan_in)
            b = torch.zeros(out, len(slices) * rank)
            for j, module in enumerate(PROJECTIONS[proj]):
                ab = pairs.get((layer, module))
                if ab is None:
                    continue
                r = ranks[(layer, module)]
                mkey = f"layers.{layer}.{module}"
                alpha = _pattern_value(conf.get("alpha_pattern"), mkey, alpha0)
                scale = alpha / (math.sqrt(r) if rs else r)
                c0, w = slices[j]
                a[j * rank:j * rank + r] = ab["A"]
                b[c0:c0 + w, j * rank:j * rank + r] = ab["B"] * scale
            a_l[proj], b_l[proj] = a, b
        adapter.a.append(a_l)
        adapter.b.append(b_l)
    return adapter
