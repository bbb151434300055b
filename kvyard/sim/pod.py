"""One simulated pod's state: its address and role, engine, tokenizer, KV-event publisher
and P/D counters; what the HTTP handlers (server.py), /metrics (metrics.py) and the
prefill leg (pd.py) share."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvyard.common import wire
from kvyard.common.tokenizer import ChatTokenizer
from kvyard.sim.engine import SimEngine
from kvyard.sim.events import SimPublisher


@dataclass(slots=True)
class Pod:
    address: str
    role: str
    engine: SimEngine
    tokenizer: ChatTokenizer
    served: list[str]
    max_model_len: int
    profile_name: str
    text_of: Any                         # token id -> the text it adds (filler ids only)
    publisher: SimPublisher | None = None
    pd_key: bytes | None = None
    session: Any = None                  # aiohttp.ClientSession for P/D prefill legs
    handoffs: int = 0
    fallbacks: int = 0
    rejected: int = 0
    started: float = field(default_factory=time.time)
    ready_at: float = 0.0                # monotonic; 503 before it (startup.py, --start-delay)

    @property
    def headers(self) -> dict[str, str]:
        return {wire.ENDPOINT_HEADER: self.address}

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters a request may name (lora.py)."""
        return list(self.engine.lora.modules) if self.engine.lora is not None else []

    def text(self, ids: list[int]) -> str:
        return "".join(self.text_of(i) for i in ids)
