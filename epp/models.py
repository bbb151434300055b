"""Several models behind one EPP: which pool serves a request's `model`, and the gateway's
combined `/v1/models`.

GAIE and llm-d run one InferencePool per base model and route by the body's `model`
(GAIE's body-based routing picks the pool, InferenceObjective/InferenceModel names map to
it). Here one EPP holds every pool's endpoints, each labelled with its pool
(`EndpointSpec.pool`: the endpoints file's `pool:`, the pod label `kvyard.io/pool`), and
this table maps every name a client may ask for to its pool:

    models:
      - name: alpha                # a base model; its pool defaults to its name
        pool: alpha
        adapters: [sql-lora, chat-lora]   # LoRA adapters served by alpha's workers
      - name: beta
        tokenizer: /models/beta    # its workers' tokenizer, if not the EPP's --model

A base name or an adapter name selects its pool (an adapter also sets
`SchedRequest.adapter`, read by the lora-affinity scorer); any other name is a 404
(OpenAI's `model_not_found`). Endpoints without a pool serve every pool, so a one-pool
deployment needs no labels. `GET /v1/models` is answered by the EPP from this table: every
base model, and every adapter with `parent` = its base, as vLLM lists them.

`tokenizer` (demo, a .gguf or a HF dir) says how a pool's workers tokenize, where that is
not the EPP's own `--model`: the EPP then renders and tokenizes that pool's prompts (its
adapters' too) with it (`pool_tokenizers`), so precise prefix keys match the blocks those
workers report.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .request import Rejection


@dataclass(slots=True, frozen=True)
class ModelRoute:
    name: str
    pool: str
    parent: str | None = None  # an adapter's base model; None: a base model
    tokenizer: str | None = None  # its pool's tokenizer source; None: the EPP's --model


class ModelListing(Rejection):
    """The EPP's own 200 answer to `GET /v1/models` (an immediate response, as a rejection
    is; `Director.handle` returns it without counting an error)."""

    def __init__(self, payload: bytes) -> None:
        Rejection.__init__(self, 200, "", "models")
        self.message = payload.decode()

    def body(self) -> bytes:
        return self.message.encode()


def _name(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v or len(v) > 256:
        raise ValueError(f"{where}: want a non-empty name, got {v!r}")
    return v


@dataclass(slots=True)
class ModelRoutes:
    routes: dict[str, ModelRoute] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def parse(cls, data: Any) -> "ModelRoutes":
        """From the YAML shape above (a mapping with `models:` or the bare list)."""
        if isinstance(data, dict):
            data = data.get("models")
        if not isinstance(data, list) or not data:
            raise ValueError("models: want a non-empty list of {name, pool, adapters}")
        out = cls()
        for i, m in enumerate(data):
            where = f"models[{i}]"
            if isinstance(m, str):
                m = {"name": m}
            if not isinstance(m, dict):
                raise ValueError(f"{where}: want {{name, pool, adapters}}")
            unknown = sorted(set(m) - {"name", "pool", "adapters", "tokenizer"})
            if unknown:
                raise ValueError(f"{where}.{unknown[0]}: unknown key (name, pool, adapters, "
                                 "tokenizer)")
            name = _name(m.get("name"), f"{where}.name")
            pool = _name(m.get("pool", name), f"{where}.pool")
            tok = None if m.get("tokenizer") is None else _name(m["tokenizer"],
                                                                 f"{where}.tokenizer")
            out._add(ModelRoute(name, pool, tokenizer=tok), where)
            adapters = m.get("adapters") or []
            if not isinstance(adapters, list):
                raise ValueError(f"{where}.adapters: want a list of names")
            for j, a in enumerate(adapters):
                out._add(ModelRoute(_name(a, f"{where}.adapters[{j}]"), pool, name, tok),
                         f"{where}.adapters[{j}]")
        return out

    @classmethod
    def load(cls, path: str | Path) -> "ModelRoutes":
        try:
            return cls.parse(yaml.safe_load(Path(path).read_text()))
        except yaml.YAMLError as e:
            raise ValueError(f"not YAML: {e}") from None

    def _add(self, r: ModelRoute, where: str) -> None:
        if r.name in self.routes:
            raise ValueError(f"{where}: {r.name!r} is named twice")
        self.routes[r.name] = r

    @property
    def names(self) -> list[str]:
        return list(self.routes)

    @property
    def pools(self) -> list[str]:
        return list(dict.fromkeys(r.pool for r in self.routes.values()))

    def get(self, model: str) -> ModelRoute | None:
        return self.routes.get(model)

    def pool_tokenizers(self, default: str) -> dict[str, str]:
        """Each pool whose tokenizer is not `default` (the EPP's --model) -> its source.
        Raises ValueError where one pool names two."""
        out: dict[str, str] = {}
        for r in self.routes.values():
            if r.tokenizer is None or r.tokenizer == default:
                continue
            if out.setdefault(r.pool, r.tokenizer) != r.tokenizer:
                raise ValueError(f"pool {r.pool!r}: two tokenizers ({out[r.pool]!r}, "
                                 f"{r.tokenizer!r})")
        return out

    def listing(self) -> ModelListing:
        """OpenAI's model list: base models (`parent` null) and adapters (`parent` = base)."""
        data = [{"id": r.name, "object": "model", "created": self.created,
                 "owned_by": "kvyard", "root": r.parent or r.name, "parent": r.parent}
                for r in self.routes.values()]
        return ModelListing(json.dumps({"object": "list", "data": data}).encode())
