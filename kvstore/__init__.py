"""kvyard.kvstore: a tiered store of KV-cache blocks (DRAM ▸ SSD ▸ Redis).

It knows blocks and bytes, not engines: never import torch or kvyard.workers
here. The engine side lives in `kvyard.workers.kvconnector`.
"""
from kvyard.kvstore.layout import KVLayout, Namespace
from kvyard.kvstore.store import KVStore, StoreConfig

__all__ = ["KVLayout", "Namespace", "KVStore", "StoreConfig"]
