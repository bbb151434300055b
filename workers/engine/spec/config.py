"""`--speculative-config`: vLLM's JSON form, parsed and checked once.

`{"method": "ngram" | "draft_model", "num_speculative_tokens": k, "model": ..,
"prompt_lookup_max": .., "prompt_lookup_min": ..}` as vLLM takes it, plus kvyard's
`"policy": "auto" | "always"` (auto: speculation pauses for a request whose drafts are
mostly rejected, policy.py) and, for a draft model, `"draft_layers"` (keep the first N
decoder layers of the draft: a layer-truncated copy) and `"draft_dtype"`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
POLICIES = ("auto", "always")


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None            # draft_model: 'demo', a .gguf file or an HF directory
    draft_layers: int | None = None     # draft_model: keep only the first N decoder layers
    draft_dtype: str | None = None      # draft_model: float32 | bfloat16 (default: the target's)
    policy: str = "auto"
    min_acceptance: float = 0.35        # auto: below this share of draft tokens accepted, pause
    pause_steps: int = 32               # auto: decode steps a paused request runs plainly
    min_drafts: int = 4                 # auto: drafts seen before a request may be paused

    @classmethod
    def parse(cls, raw: str | dict[str, Any] | None) -> "SpeculativeConfig | None":
        """None for no speculation; ValueError naming what is wrong otherwise."""
        if raw is None:
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative config must be a JSON object")
        known = set(cls.__slots__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys: {', '.join(unknown)}")
        cfg = cls(**raw)
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be an integer in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method draft_model needs a 'model'")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError("draft_layers must be at least 1")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError("min_acceptance must be in [0, 1]")
