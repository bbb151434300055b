"""The bridge between the engine's KV-cache tensors and kvyard.kvstore.

`connector.py` is the engine's KVConnector (workers/engine/api.py) over a
tiered KVStore: block layout, lookup, and the CPU paths of load and save.
`staging.py` holds the paths for KV caches on a CUDA device (pinned frames for
saves, in-place copies of DRAM hits, double-buffered staging for other hits).
`flags.py` builds a connector from the worker's `--kv-*` flags.
"""
from __future__ import annotations

from kvyard.kvstore.flags import add_kv_arguments, store_config
from kvyard.workers.pinned_arena import PinnedArena

from .connector import StoreConnector
from .flags import build_connector, model_identity_of
from .staging import _SLAB_BYTES

__all__ = ["PinnedArena", "StoreConnector", "add_kv_arguments", "build_connector",
           "model_identity_of", "store_config", "_SLAB_BYTES"]
