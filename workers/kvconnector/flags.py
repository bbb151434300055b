"""Building the worker's connector from its `--kv-*` flags (kvstore/flags.py)."""
from __future__ import annotations

import argparse
from typing import Any

from kvyard.kvstore import KVLayout
from kvyard.kvstore.flags import store_config

from .connector import StoreConnector


def model_identity_of(model_ref: str) -> str:
    """'<model name>@<weights fingerprint>': what the namespace digest is made of."""
    from kvyard.common.models import fingerprint, resolve_model

    src = resolve_model(model_ref)
    return f"{src.served_name}@{fingerprint(src)}"


def build_connector(args: argparse.Namespace, model: Any,
                    layout: KVLayout | None = None) -> StoreConnector | None:
    """A connector, or None when no tier is configured.

    `model` is the model identity string, or the EngineConfig (the worker's
    server passes that), from whose `model` the identity is derived.
    """
    cfg = store_config(args)
    if not cfg.any_tier:
        return None
    identity = model if isinstance(model, str) else model_identity_of(model.model)
    return StoreConnector(cfg, identity, layout)
