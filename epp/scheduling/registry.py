"""The plugins a scheduler config can name, by kind: one line each.

A plugin class without parameters is built as `cls()`; one with parameters
declares a params dataclass (`plugin_config.param` fields, checked at load)
and a `build(params)` classmethod. Registered classes must subclass the hook
protocol of their kind (`hooks.py`), so their hooks are checked when they are
built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .filters import DecodeRoleFilter, HealthyFilter, PreferFreshFilter, PrefillRoleFilter
from .handlers import DisaggParams, DisaggProfileHandler, SingleProfileHandler
from .hooks import Filter, Picker, Scorer
from .pickers import MaxScoreParams, MaxScorePicker, RoundRobinPicker
from .plugin_config import NoParams
from .scorers.kv_utilization import KvUtilizationScorer
from .scorers.lora_affinity import LoraAffinityParams, LoraAffinityScorer
from .scorers.latency import LatencyParams, LatencyScorer
from .scorers.precise_prefix import PrecisePrefixParams, PrecisePrefixScorer
from .scorers.prefix_cache import PrefixCacheParams, PrefixCacheScorer
from .scorers.queue import QueueScorer


@dataclass(slots=True, frozen=True)
class PluginType:
    """A plugin as the config names it: its class and its parameters' dataclass."""

    cls: type
    params: type = NoParams

    def build(self, params: Any) -> Any:
        return self.cls() if self.params is NoParams else self.cls.build(params)

    @property
    def doc(self) -> str:
        return self.cls.__doc__ or ""


FILTERS: dict[str, PluginType] = {
    "healthy": PluginType(HealthyFilter),
    "prefer-fresh": PluginType(PreferFreshFilter),
    "role": PluginType(DecodeRoleFilter),
    "prefill-role": PluginType(PrefillRoleFilter),
}
SCORERS: dict[str, PluginType] = {
    "queue": PluginType(QueueScorer),
    "kv-cache-utilization": PluginType(KvUtilizationScorer),
    "prefix-cache": PluginType(PrefixCacheScorer, PrefixCacheParams),
    "precise-prefix-cache": PluginType(PrecisePrefixScorer, PrecisePrefixParams),
    "lora-affinity": PluginType(LoraAffinityScorer, LoraAffinityParams),
    "latency": PluginType(LatencyScorer, LatencyParams),
}
PICKERS: dict[str, PluginType] = {
    "max-score": PluginType(MaxScorePicker, MaxScoreParams),
    "round-robin": PluginType(RoundRobinPicker, MaxScoreParams),
}
PROFILE_HANDLERS: dict[str, PluginType] = {
    "single-profile": PluginType(SingleProfileHandler),
    "disagg-profile-handler": PluginType(DisaggProfileHandler, DisaggParams),
}
# What each kind's classes must implement (checked by a test over every entry).
KINDS: dict[str, tuple[dict[str, PluginType], type | None]] = {
    "filter": (FILTERS, Filter), "scorer": (SCORERS, Scorer), "picker": (PICKERS, Picker),
    "profile handler": (PROFILE_HANDLERS, None),
}
