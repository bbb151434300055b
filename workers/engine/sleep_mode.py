"""vLLM's sleep mode, engine side: give the device back without exiting, wake in place.

Level 1: the weights move to pinned host memory (on CPU they already are in host
memory and stay where they are) and the KV cache is dropped. Level 2: both are
dropped; waking reloads the weights from the model source (`config.model`).
Dropping the KV cache means its contents are gone: the prefix cache is cleared
(the block manager's KV event seam reports `all_cleared`, vLLM's
AllBlocksCleared). On CUDA the cache tensors' storage is freed (`resize_(0)`) and
re-allocated, zeroed, on wake; the tensors themselves (the Python objects) survive,
so the KV connector, which reads them per call, still holds the right ones (it is
not re-bound: that would drop its store). On CPU the cache memory is kept and
zeroed on wake: the P/D peer server and the connector keep numpy views of the CPU
cache, which a freed storage would leave dangling.

Weights at level 1 move per storage (deduplicated by address: tied embeddings,
views and packed tiles count once), found by walking the model's tensors,
including the ones kept outside nn.Module (LayerWeights, ops state). A storage
is copied to pinned host memory, then resized to 0 bytes, so the device memory
goes back (after `empty_cache`) while every tensor keeps its shape and strides;
waking resizes it back and copies the bytes in.

CUDA graphs: the captured decode graphs read fixed addresses of the weights and
the KV cache, which a wake does not preserve (the caching allocator hands out
new blocks). So sleeping drops the graphs (and their memory pool) and waking
re-captures them and re-runs the eager warm-up, before the wake returns: the
first request after a wake replays valid graphs. That capture is part of the
measured wake time.

Runs on the engine thread only, with no request in the engine (the caller drains
first: see kvyard.workers.server.sleep).
"""
from __future__ import annotations

import gc
import time
from typing import Any

import torch
from torch import nn

LEVELS = (1, 2)


def _tensors(root: Any) -> list[torch.Tensor]:
    """Every tensor reachable from the model through modules, kvyard objects and containers."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, nn.Module):
            stack.extend(o._parameters.values())
            stack.extend(o._buffers.values())
            stack.extend(o._modules.values())
            stack.extend(v for v in vars(o).values() if not isinstance(v, dict))
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif type(o).__module__.startswith("kvyard"):
            stack.extend(getattr(o, s, None) for s in getattr(type(o), "__slots__", ()))
            stack.extend(getattr(o, "__dict__", {}).values())
    return out


def _storages(tensors: list[torch.Tensor], device_type: str) -> list[torch.UntypedStorage]:
    by_ptr: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type == device_type and t.numel():
            try:
                s = t.untyped_storage()
            except (NotImplementedError, RuntimeError):  # opaque (packed) tensors: they stay
                continue
            if s.nbytes() and s.resizable():   # not resizable (mmap, DLPack): it stays
                by_ptr.setdefault(s.data_ptr(), s)
    return list(by_ptr.values())


def _bytes_of(s: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)


class SleepMode:
    """The sleeping state of one LLMEngine (created on the first sleep)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.level = 0                 # 0 = awake
        self._host: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self.last_sleep_s = self.last_wake_s = 0.0

    @property
    def sleeping(self) -> bool:
        return self.level != 0

    @torch.inference_mode()
    def sleep(self, level: int) -> None:
        if level not in LEVELS:
            raise ValueError(f"sleep level must be 1 or 2, not {level}")
        eng = self.engine
        if self.sleeping:
            if level <= self.level:
                return
            self._host.clear()           # level 1 -> 2: the host copies go too
            eng.runner.model = None
            self.level = level
            gc.collect()
            return
        if eng.has_unfinished_requests():
            raise RuntimeError("sleep with requests in the engine (drain or abort them first)")
        t0 = time.perf_counter()
        for ids in eng.kv_holds.drain():
            eng.block_manager.release(ids)
        eng.block_manager.reset_prefix_cache()
        runner = eng.runner
        cuda = runner.device.type == "cuda"
        runner.graphs = None             # they read the addresses about to go away
        if cuda:
            torch.cuda.synchronize()     # every stream: e.g. the connector's last save gather
            for t in runner.kv_caches:
                t.untyped_storage().resize_(0)
        if level == 1:
            if cuda:
                for s in _storages(_tensors(runner.model), "cuda"):
                    host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=True)
                    host.copy_(_bytes_of(s), non_blocking=True)
                    self._host.append((s, host))
                torch.cuda.synchronize()
                for s, _ in self._host:
                    s.resize_(0)
        else:
            runner.model = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        self.level = level
        self.last_sleep_s = time.perf_counter() - t0

    @torch.inference_mode()
    def wake_up(self) -> None:
        if not self.sleeping:
            return
        t0 = time.perf_counter()
        eng = self.engine
        runner = eng.runner
        if runner.model is None:         # level 2: from the model source again
            from kvyard.common.models import resolve_model
            from kvyard.workers.model import load_model

            cfg = eng.config
            runner.model, _ = load_model(resolve_model(cfg.model), eng.dtype, cfg.max_model_len,
                                         device=runner.device)
        else:
            for s, host in self._host:
                s.resize_(host.numel())
                _bytes_of(s).copy_(host, non_blocking=True)
        for t in runner.kv_caches:
            s = t.untyped_storage()
            if s.nbytes() == 0:
                s.resize_(t.numel() * t.element_size())
            t.zero_()
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        self._host.clear()
        runner.rebuild_device_state()    # CUDA graphs re-captured, warm-up re-run
        self.level = 0
        self.last_wake_s = time.perf_counter() - t0
