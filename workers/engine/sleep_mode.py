"""vLLM's sleep mode, engine side: give the device back without exiting, wake in place.

Level 1: the weights move to pinned host memory (on CPU they already are in host
memory and stay where they are) and the KV cache is dropped. Level 2: both are
dropped; waking reloads the weights from the model source (`config.model`).
Dropping the KV cache means its contents are gone: the prefix cache is cleared
(the block manager's KV event seam reports `all_cleared`, vLLM's
AllBlocksCleared). On CUDA the cache's memory is freed and re-allocated, zeroed, on
wake; the tensors themselves (the Python objects) survive,
so the KV connector, which reads them per call, still holds the right ones (it is
not re-bound: that would drop its store). On CPU the cache memory is kept and
zeroed on wake: the P/D peer server and the connector keep numpy views of the CPU
cache, which a freed storage would leave dangling.

On CUDA the runner normally keeps its weights and KV cache in fixed-address arenas
(sleep_arena.py, over cuda_vmm.py): sleeping releases their memory, waking maps new
memory at the same addresses and copies the weights in (level 1: one copy from a
pinned host buffer; level 2: a reload from the model source), so the captured decode
CUDA graphs stay valid and are not captured again. The graphs and their memory pool
stay allocated while asleep (as in vLLM, whose graphs survive sleep for the same
reason). `last_parts` has the timed steps of the last sleep or wake.

Without the arenas (the driver's virtual memory API unavailable) weights at level 1
move per storage (deduplicated by address: tied embeddings, views and packed tiles
count once), found by walking the model's tensors, including the ones kept outside
nn.Module (LayerWeights, ops state): copied to pinned host memory, then resized to
0 bytes, so the device memory goes back (after `empty_cache`) while every tensor
keeps its shape and strides; waking resizes it back and copies the bytes in. The
caching allocator then hands out new addresses, so sleeping drops the graphs and
waking re-captures them (0.7 s for the 8B shape) before it returns.

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
        self.last_parts: dict[str, float] = {}

    @property
    def sleeping(self) -> bool:
        return self.level != 0

    @torch.inference_mode()
    def sleep(self, level: int) -> None:
        if level not in LEVELS:
            raise ValueError(f"sleep level must be 1 or 2, not {level}")
        eng = self.engine
        runner = eng.runner
        arenas = getattr(runner, "arenas", None)
        if self.sleeping:
            if level <= self.level:
                return
            if arenas is not None:       # level 1 -> 2: the host copy goes too
                arenas.sleep(2)
            else:
                self._host.clear()
                runner.model = None
            self.level = level
            gc.collect()
            return
        if eng.has_unfinished_requests():
            raise RuntimeError("sleep with requests in the engine (drain or abort them first)")
        t0 = time.perf_counter()
        eng.handoff.drain()
        eng.block_manager.reset_prefix_cache()
        cuda = runner.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()     # every stream: e.g. the connector's last save gather
        if arenas is not None:
            arenas.sleep(level)          # the graphs stay: the addresses will be the same
            self.last_parts = dict(arenas.parts)
        else:
            self._sleep_plain(level, cuda)
        self.level = level
        self.last_sleep_s = time.perf_counter() - t0

    def _sleep_plain(self, level: int, cuda: bool) -> None:
        runner = self.engine.runner
        runner.graphs = None             # they read the addresses about to go away
        if cuda:
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

    def _reload(self, parts: dict[str, float] | None = None) -> Any:
        """The model from its source again: an HF directory into the arenas streamed by
        fast_reload.py, anything else (GGUF, no arenas) through the loader."""
        from kvyard.common.models import resolve_model
        from kvyard.workers.model import load_model

        eng = self.engine
        cfg, runner = eng.config, eng.runner
        src = resolve_model(cfg.model)
        arenas = getattr(runner, "arenas", None)
        if arenas is not None and arenas.ring is not None and src.kind == "hf" and cfg.quantization is None:
            from .fast_reload import reload_hf

            return reload_hf(src.path, eng.dtype, cfg.max_model_len, runner.device, arenas.ring, parts)
        model, _ = load_model(src, eng.dtype, cfg.max_model_len, device=runner.device,
                              quantization=cfg.quantization)
        return model

    @torch.inference_mode()
    def wake_up(self) -> None:
        if not self.sleeping:
            return
        t0 = time.perf_counter()
        runner = self.engine.runner
        arenas = getattr(runner, "arenas", None)
        if arenas is not None:
            arenas.wake(runner.model, self._reload)
            self.last_parts = dict(arenas.parts)
        else:
            self._wake_plain()
        self.level = 0
        self.last_wake_s = time.perf_counter() - t0

    def _wake_plain(self) -> None:
        runner = self.engine.runner
        t0 = time.perf_counter()
        if runner.model is None:         # level 2: from the model source again
            runner.model = self._reload()
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
        t1 = time.perf_counter()
        runner.rebuild_device_state()    # CUDA graphs re-captured, warm-up re-run
        self.last_parts = {"restore_s": t1 - t0, "rebuild_s": time.perf_counter() - t1}
