"""A `Scheduler` from the scheduler YAML, validated at load.

    blockSize: 64                      # prompt block size for every prefix plugin
    profileHandler: {type: single-profile}
    profiles:
      default:
        filters: [healthy, prefer-fresh, role]
        scorers:
          - {type: precise-prefix-cache, weight: 3, lruCapacityPerServer: 31250}
          - {type: queue, weight: 2}
          - {type: kv-cache-utilization, weight: 2}
          - {type: lora-affinity, weight: 4}
        picker: {type: max-score}      # random tie-break
    objectives: {batch: -1}            # x-gateway-inference-objective -> priority

With one profile, `filters`/`scorers`/`picker` may sit at the top level
instead of under `profiles` (a profile named `default`). Names follow the
reference EPP so configs read the same. Plugins are looked up in
`registry.py`; every plugin's parameters are typed and checked when the config
loads (`plugin_config`): unknown plugins, unknown parameters and bad values
are errors naming their config path.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import yaml

from .hooks import Scorer
from .plugin_config import ConfigError, parse_params
from .profile import SchedulingProfile
from .registry import FILTERS, PICKERS, PROFILE_HANDLERS, SCORERS, PluginType
from .scheduler import Scheduler

DEFAULT_PROFILE: dict[str, Any] = {
    "filters": ["healthy", "prefer-fresh", "role"],
    "scorers": [
        # KV events where an endpoint publishes them, else prefix-cache's approximate index
        {"type": "precise-prefix-cache", "weight": 3, "lruCapacityPerServer": 31_250},
        {"type": "queue", "weight": 2},
        {"type": "kv-cache-utilization", "weight": 2},
        {"type": "lora-affinity", "weight": 4},  # neutral for base models
    ],
    "picker": {"type": "max-score"},
}
DEFAULT_CONFIG: dict[str, Any] = {**DEFAULT_PROFILE, "blockSize": 64, "objectives": {}}
# flowControl is the admission stage's (flow/config.py), checked by `parse_flow_config`.
_TOP_KEYS = ("blockSize", "objectives", "profileHandler", "profiles", "flowControl",
             *DEFAULT_PROFILE)


def _plugin(kind: str, table: dict[str, PluginType], raw: Any, path: str,
            ignore: tuple[str, ...] = ("type",)) -> Any:
    name = raw if isinstance(raw, str) else raw.get("type") if isinstance(raw, dict) else None
    if name not in table:
        raise ConfigError(path, f"unknown {kind} {name!r}; known: {sorted(table)}")
    t = table[name]
    return t.build(parse_params(t.params, raw if isinstance(raw, dict) else {}, path, ignore))


def _profile(name: str, raw: Any, path: str) -> SchedulingProfile:
    if not isinstance(raw, dict):
        raise ConfigError(path, f"a profile must be a mapping, got {raw!r}")
    for k in raw:
        if k not in DEFAULT_PROFILE:
            raise ConfigError(f"{path}.{k}", "unknown key (a profile has filters, scorers, picker)")
    filters = [_plugin("filter", FILTERS, f, f"{path}.filters[{i}]")
               for i, f in enumerate(raw.get("filters") or [])]
    scorers: list[tuple[Scorer, float]] = []
    for i, s in enumerate(raw.get("scorers") or []):
        p = f"{path}.scorers[{i}]"
        if not isinstance(s, dict):
            raise ConfigError(p, f"a scorer must be a mapping with a type, got {s!r}")
        weight = s.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise ConfigError(f"{p}.weight", f"must be a number >= 0, got {weight!r}")
        scorer = _plugin("scorer", SCORERS, s, p, ignore=("type", "weight"))
        if weight:
            scorers.append((scorer, float(weight)))
    picker = _plugin("picker", PICKERS, raw.get("picker") or {"type": "max-score"},
                     f"{path}.picker")
    return SchedulingProfile(name, filters, scorers, picker)


def build_scheduler(cfg: dict[str, Any] | None = None, seed: int | None = None) -> Scheduler:
    """A scheduler from a config mapping (defaults filled in); ConfigError if it is wrong."""
    cfg = dict(cfg or {})
    for k in cfg:
        if k not in _TOP_KEYS:
            raise ConfigError(k, f"unknown key; known: {sorted(_TOP_KEYS)}")
    flat = {k: cfg[k] for k in DEFAULT_PROFILE if k in cfg}
    if "profiles" in cfg:
        if flat:
            raise ConfigError(next(iter(flat)), "give filters/scorers/picker inside `profiles`, "
                                                "not beside it")
        raw_profiles = cfg["profiles"]
        if not isinstance(raw_profiles, dict) or not raw_profiles:
            raise ConfigError("profiles", "must be a non-empty mapping of name -> profile")
    else:
        raw_profiles = {"default": {**DEFAULT_PROFILE, **flat}}
    profiles = {str(n): _profile(str(n), p, f"profiles.{n}") for n, p in raw_profiles.items()}
    handler = _plugin("profile handler", PROFILE_HANDLERS,
                      cfg.get("profileHandler") or {"type": "single-profile"}, "profileHandler")
    if handler.name == "single-profile" and len(profiles) != 1:
        raise ConfigError("profiles", f"single-profile runs exactly one profile, got "
                                      f"{len(profiles)}")
    for key in ("decode", "prefill"):
        want = getattr(handler, key, None)
        if want is not None and want not in profiles:
            raise ConfigError(f"profileHandler.{key}Profile",
                              f"no profile named {want!r}; profiles: {sorted(profiles)}")
    block_size = cfg.get("blockSize", 64)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("blockSize", f"must be an integer >= 1, got {block_size!r}")
    objectives = cfg.get("objectives") or {}
    if not isinstance(objectives, dict):
        raise ConfigError("objectives", "must be a mapping of name -> priority")
    for k, v in objectives.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"objectives.{k}", f"must be an integer priority, got {v!r}")
    return Scheduler(profiles, handler, block_size, {str(k): v for k, v in objectives.items()},
                     random.Random(seed))


def with_fallbacks(cfg: dict[str, Any], fallbacks: int) -> dict[str, Any]:
    """`cfg` with every profile's picker listing `fallbacks` more endpoints after its pick."""
    def picker(p: dict[str, Any]) -> dict[str, Any]:
        raw = p.get("picker") or {"type": "max-score"}
        return {**p, "picker": {**raw, "maxEndpoints": fallbacks + 1}}
    if isinstance(cfg.get("profiles"), dict):
        return {**cfg, "profiles": {n: picker(p) if isinstance(p, dict) else p
                                    for n, p in cfg["profiles"].items()}}
    return picker(cfg)


def load_config(path: str | Path | None) -> dict[str, Any]:
    if not path:
        return dict(DEFAULT_CONFIG)
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "scheduler config must be a mapping")
    return data
