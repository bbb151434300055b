"""The adapters a worker serves, their weights in host memory, and the device slots.

Three tiers, as vLLM's: the *served* names (from --lora-modules and the load API; a
request may name any of them), an LRU of *loaded* adapters in host memory bounded by
--max-cpu-loras (an adapter evicted from it is read from its path again when asked
for), and --max-loras *slots*: stacked per-projection weights on the model's device
that a batch's rows index. The scheduler admits at most --max-loras distinct adapters
into the running batch, so a step's adapters always fit the slots.

`add`/`remove`/`served` may be called from any thread (the server's); `activate`,
which fills slots and trims the host LRU, runs on the engine thread only.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .. import cpu_ops
from ..cpu_ops.lora_args import LoraWeights
from .adapter import PROJECTIONS, LoRAAdapter, LoRAError, load_adapter, projection_shapes
from .batch import NO_SLOT, CpuLoRA, LoRABatch
from .config import LoRAConfig, LoRAModule


@dataclass(slots=True)
class LoRAStats:
    loads: int = 0                 # adapters read from disk
    load_seconds: float = 0.0
    slot_fills: int = 0            # adapters copied into a device slot
    last_load_seconds: float = 0.0


@dataclass(slots=True)
class LoRAManager:
    config: LoRAConfig
    model_config: object
    device: torch.device
    dtype: torch.dtype
    served: dict[str, LoRAModule] = field(default_factory=dict)
    host: "OrderedDict[str, LoRAAdapter]" = field(default_factory=OrderedDict)
    slot_names: list[str | None] = field(default_factory=list)
    slot_projs: list[frozenset[str]] = field(default_factory=list)
    slot_tick: list[int] = field(default_factory=list)
    stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    stats: LoRAStats = field(default_factory=LoRAStats)
    use_kernels: bool = True       # CPU: lora.c when the C kernels load (False: torch per group)
    cpu: CpuLoRA | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    _tick: int = 0

    def __post_init__(self) -> None:
        n, r = self.config.max_loras, self.config.max_lora_rank
        self.slot_names = [None] * n
        self.slot_projs = [frozenset()] * n
        self.slot_tick = [0] * n
        shapes = projection_shapes(self.model_config)
        kernels = cpu_ops.load() if self.device.type == "cpu" and self.use_kernels \
            and self.dtype in (torch.bfloat16, torch.float32) else None
        for _ in range(self.model_config.num_layers):
            layer = {}
            for proj, (fan_in, slices) in shapes.items():
                out = slices[-1][0] + slices[-1][1]
                k = len(slices) * r
                # lora.c streams B's rows along the output: stored transposed for it
                b = torch.zeros(n, k, out, dtype=self.dtype, device=self.device).transpose(1, 2) \
                    if kernels is not None else torch.zeros(n, out, k, dtype=self.dtype, device=self.device)
                layer[proj] = (torch.zeros(n, k, fan_in, dtype=self.dtype, device=self.device), b)
            self.stacks.append(layer)
        if kernels is not None:
            noff = {p: torch.tensor([c for c, _ in sl] + [sl[-1][0] + sl[-1][1]], dtype=torch.int32)
                    for p, (_, sl) in shapes.items()}
            self.cpu = CpuLoRA(kernels, [{p: LoraWeights.prepare(a, b, noff[p]) for p, (a, b) in layer.items()}
                                         for layer in self.stacks], {p: [0] * n for p in shapes})

    # ---- any thread ------------------------------------------------------------
    def load(self, module: LoRAModule) -> LoRAAdapter:
        """Read `module` from disk (slow: call it off the event loop), timed."""
        t0 = time.perf_counter()
        adapter = load_adapter(module.path, module.name, self.model_config, self.config.max_lora_rank,
                               module.base_model_name)
        dt = time.perf_counter() - t0
        with self.lock:
            self.stats.loads += 1
            self.stats.load_seconds += dt
            self.stats.last_load_seconds = dt
        return adapter

    def add(self, module: LoRAModule) -> LoRAAdapter:
        """Serve `module` under its name: its weights are read and validated now."""
        with self.lock:
            if module.name in self.served:
                raise LoRAError(f"The lora adapter '{module.name}' has already been loaded.")
        adapter = self.load(module)
        with self.lock:
            if module.name in self.served:
                raise LoRAError(f"The lora adapter '{module.name}' has already been loaded.")
            self.served[module.name] = module
            self.host[module.name] = adapter   # trimmed to max_cpu_loras by the engine thread
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving `name`; requests already in the engine finish with it."""
        with self.lock:
            if self.served.pop(name, None) is None:
                raise KeyError(name)
            # a name served again later may be other weights: its slot no longer counts as
            # loaded (requests still running with it refill a slot from the host copy)
            self.slot_names = [None if n == name else n for n in self.slot_names]

    def modules(self) -> list[LoRAModule]:
        with self.lock:
            return list(self.served.values())

    def serves(self, name: str) -> bool:
        with self.lock:
            return name in self.served

    # ---- the engine thread -----------------------------------------------------
    def activate(self, names: set[str], in_use: set[str]) -> dict[str, int]:
        """Slots for `names` (at most max_loras): present ones kept, others filled over
        slots no name of this batch needs, least recently used first. `in_use`: every
        adapter a request in the engine names (kept in host memory past the LRU bound)."""
        if len(names) > len(self.slot_names):
            raise LoRAError(f"{len(names)} adapters in one batch, --max-loras is {len(self.slot_names)}")
        self._tick += 1
        where: dict[str, int] = {}
        for s, n in enumerate(self.slot_names):
            if n in names:
                where[n] = s
                self.slot_tick[s] = self._tick
        for name in names - where.keys():
            free = [s for s, n in enumerate(self.slot_names) if n not in names]
            s = min(free, key=lambda i: (self.slot_names[i] is not None, self.slot_tick[i]))
            self._fill(s, self._host_adapter(name))
            where[name] = s
            self.slot_tick[s] = self._tick
        self._trim_host(in_use | names)
        return where

    def batch(self, row_names: list[str | None], in_use: set[str]) -> LoRABatch | None:
        """The step's LoRABatch for per-row adapter names; None when no row has one."""
        names = {n for n in row_names if n is not None}
        if not names:
            return None
        where = self.activate(names, in_use)
        projs = frozenset().union(*(self.slot_projs[where[n]] for n in names))
        slots = [NO_SLOT if n is None else where[n] for n in row_names]
        return LoRABatch.build(slots, self.stacks, projs, len(self.slot_names), self.device, self.cpu)

    def active_names(self) -> list[str]:
        return [n for n in self.slot_names if n is not None]

    def _host_adapter(self, name: str) -> LoRAAdapter:
        with self.lock:
            adapter = self.host.get(name)
            if adapter is not None:
                self.host.move_to_end(name)
                return adapter
            module = self.served.get(name)
        if module is None:
            raise LoRAError(f"The lora adapter '{name}' cannot be found.")
        adapter = self.load(module)
        with self.lock:
            self.host[name] = adapter
        return adapter

    def _trim_host(self, keep: set[str]) -> None:
        with self.lock:
            over = len(self.host) - self.config.max_cpu_loras
            for name in [n for n in self.host if n not in keep][:max(over, 0)]:
                del self.host[name]

    def _fill(self, s: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into slot s, its rank padded to max_lora_rank per slice."""
        rmax, r = self.config.max_lora_rank, adapter.rank
        for layer, (a_l, b_l) in enumerate(zip(adapter.a, adapter.b)):
            for proj, (a_st, b_st) in self.stacks[layer].items():
                a_st[s].zero_()
                b_st[s].zero_()
                if proj not in a_l:
                    continue
                for j in range(len(PROJECTIONS[proj])):
                    a_st[s, j * rmax:j * rmax + r].copy_(a_l[proj][j * r:(j + 1) * r])
                    b_st[s, :, j * rmax:j * rmax + r].copy_(b_l[proj][:, j * r:(j + 1) * r])
        self.slot_names[s] = adapter.name
        self.slot_projs[s] = adapter.projections
        if self.cpu is not None:
            for proj, ranks in self.cpu.ranks.items():
                ranks[s] = r if proj in adapter.projections else 0
        self.stats.slot_fills += 1


def build_manager(config: LoRAConfig | None, model_config, device: torch.device,
                  dtype: torch.dtype) -> LoRAManager | None:
    """The engine's manager, its --lora-modules loaded (a bad one fails the start)."""
    if config is None:
        return None
    mgr = LoRAManager(config, model_config, torch.device(device), dtype)
    for module in config.modules:
        mgr.add(module)
    return mgr
