"""A simulated pod's LoRA adapters: which it serves, which are active (on the device), and
what activating one costs.

vLLM's semantics, timed instead of computed:
- `--lora-modules NAME=PATH` names the adapters a pod serves (the path is only listed);
  a request picks one by its `model`, and `/v1/models` lists it with `parent` = the base.
- At most `--max-loras` adapters are active at once; a waiting request whose adapter is
  not active and cannot get a slot (every active one is used by a running request) is
  skipped this step, as vLLM's scheduler skips it, and later requests may go first.
- Activating an adapter evicts the least recently used idle one and costs `load_s` of
  simulated time in the step that admits it (a load: what `kvyard bench lora` counts).
  The default, 500 ms, is the disk-to-GPU load lorax measured for a 7B adapter
  (predibase/lorax#433: "500ms ~ 1+s"); `--lora-load-time` sets another (the engine's own,
  measured by `kvyard bench lora`'s engine half, for instance).
- `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}`: the
  adapters of running and waiting requests, as vLLM reports them (metrics.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_LOAD_S = 0.5


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """`NAME=PATH` or a bare `NAME` (vLLM's flag; the simulator never reads the path)."""
    out: dict[str, str] = {}
    for item in items:
        for part in item.split():
            name, _, path = part.partition("=")
            if not name:
                raise ValueError(f"--lora-modules {part!r}: want NAME=PATH")
            out[name] = path or name
    return out


@dataclass(slots=True)
class AdapterSlots:
    """The adapters one pod serves and its LRU of active ones."""

    modules: dict[str, str] = field(default_factory=dict)  # name -> path
    max_loras: int = 1
    load_s: float = DEFAULT_LOAD_S
    active: OrderedDict[str, None] = field(default_factory=OrderedDict)  # oldest first
    loads: int = 0
    evictions: int = 0

    def serves(self, name: str) -> bool:
        return name in self.modules

    def acquire(self, name: str, in_use: set[str]) -> float | None:
        """Make `name` active for a request being admitted: the simulated seconds it costs
        (0 when active already), or None when every slot holds an adapter in use."""
        if name in self.active:
            self.active.move_to_end(name)
            return 0.0
        if len(self.active) >= self.max_loras:
            idle = next((a for a in self.active if a not in in_use), None)
            if idle is None:
                return None
            del self.active[idle]
            self.evictions += 1
        self.active[name] = None
        self.loads += 1
        return self.load_s
