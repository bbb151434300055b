"""The scheduling step of a request: the profile handler runs its profiles
(filters → weighted scorers → picker), then the pre-request hooks; built from
a small YAML config validated at load.

    blockSize: 64                      # prompt block size for every prefix plugin
    profileHandler: {type: single-profile}
    profiles:
      default:
        filters: [healthy, prefer-fresh, role]
        scorers:
          - {type: prefix-cache, weight: 3, lruCapacityPerServer: 31250}
          - {type: queue, weight: 2}
          - {type: kv-cache-utilization, weight: 2}
        picker: {type: max-score}      # random tie-break
    objectives: {batch: -1}            # x-gateway-inference-objective -> priority

With one profile, `filters`/`scorers`/`picker` may sit at the top level
instead of under `profiles` (a profile named `default`). Names follow the
reference EPP so configs read the same. Every plugin's parameters are typed
and checked when the config loads (`plugin_config`): unknown plugins, unknown
parameters and bad values are errors naming their config path.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from ..pool.endpoints import Endpoint
from ..prompt import LazyPrompt
from .cycle import PREFIX_MATCHES
from .plugin_config import ConfigError, parse_params
from .plugins import FILTERS, SCORERS, Filter, PluginType, SchedRequest, Scorer
from .profile import (
    PICKERS, PROFILE_HANDLERS, ProfileHandler, SchedulingProfile, SchedulingResult,
)

DEFAULT_PROFILE: dict[str, Any] = {
    "filters": ["healthy", "prefer-fresh", "role"],
    "scorers": [
        {"type": "prefix-cache", "weight": 3, "lruCapacityPerServer": 31_250},
        {"type": "queue", "weight": 2},
        {"type": "kv-cache-utilization", "weight": 2},
    ],
    "picker": {"type": "max-score"},
}
DEFAULT_CONFIG: dict[str, Any] = {**DEFAULT_PROFILE, "blockSize": 64, "objectives": {}}
# flowControl is the admission stage's (flow_config.py), checked by `parse_flow_config`.
_TOP_KEYS = ("blockSize", "objectives", "profileHandler", "profiles", "flowControl",
             *DEFAULT_PROFILE)


@dataclass(slots=True)
class Decision:
    endpoint: Endpoint
    score: float
    matched_blocks: int
    total_blocks: int  # estimated until the prompt is fully hashed
    candidates: int
    prompt: LazyPrompt | None = None
    fallbacks: list[Endpoint] = field(default_factory=list)
    result: SchedulingResult | None = None
    prefill: Endpoint | None = None  # P/D: the pod that prefills (x-prefiller-host-port)

    @property
    def destination(self) -> str:
        """`x-gateway-destination-endpoint`: the pick, then fallbacks, comma-separated."""
        if not self.fallbacks:
            return self.endpoint.address
        return ",".join([self.endpoint.address, *(e.address for e in self.fallbacks)])


def count_pick(req: SchedRequest, ep: Endpoint) -> None:
    """Our own picks since the last scrape (the queue scorer adds them) and hit counts."""
    ep.picks += 1
    ep.pending += 1
    if req.cycle.read(PREFIX_MATCHES, {}).get(ep.address, 0):
        ep.prefix_hits += 1


@dataclass(slots=True)
class Scheduler:
    profiles: dict[str, SchedulingProfile]
    handler: ProfileHandler
    block_size: int = 64
    objectives: dict[str, int] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)

    @property
    def primary(self) -> SchedulingProfile:
        return self.profiles[self.handler.primary(self.profiles)]

    @property
    def filters(self) -> list[Filter]:
        return self.primary.filters

    @property
    def scorers(self) -> list[tuple[Scorer, float]]:
        return self.primary.scorers

    @property
    def prefix_scorer(self) -> Any:
        """The primary profile's prefix-cache scorer (for tests and debugging)."""
        return next((s for s, _ in self.scorers if s.name == "prefix-cache"), None)

    def _hooks(self, name: str) -> Iterator[Callable[..., None]]:
        seen: set[int] = set()
        for prof in self.profiles.values():
            for p in prof.plugins():
                hook = getattr(p, name, None)
                if hook is not None and id(p) not in seen:
                    seen.add(id(p))
                    yield hook

    def candidates(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        """The primary profile's filtered pool (what saturation is measured on)."""
        return self.primary.candidates(req, eps)

    def schedule(self, req: SchedRequest, eps: list[Endpoint]) -> Decision | None:
        """The handler's result as a Decision (None: no endpoint), pre-request hooks run."""
        result = self.handler.run(req, self.profiles, eps, self.rng)
        if result is None:
            return None
        for name, r in result.results.items():
            picked = r.endpoints[0]
            for p in self.profiles[name].plugins():
                hook = getattr(p, "pre_request", None)
                if hook is not None:
                    hook(req, picked)
            count_pick(req, picked)
        main = result.results[result.primary]
        ep = main.endpoints[0]
        matched = req.cycle.read(PREFIX_MATCHES, {}).get(ep.address, 0)
        total = max(req.prompt.estimated_blocks(), matched)
        pre = next((r.endpoints[0] for n, r in result.results.items() if n != result.primary),
                   None)
        return Decision(ep, main.score, matched, total, main.candidates, req.prompt,
                        main.endpoints[1:], result, pre)

    def learn(self, address: str, hashes: list[int]) -> None:
        """Post-response: the whole prompt of a request routed to `address`, once hashed."""
        for hook in self._hooks("learn"):
            hook(address, hashes)

    def forget(self, address: str) -> None:
        """An endpoint left the pool: drop what plugins believed about it."""
        for hook in self._hooks("forget"):
            hook(address)


def _plugin(kind: str, table: dict[str, PluginType], raw: Any, path: str,
            ignore: tuple[str, ...] = ("type",)) -> Any:
    name = raw if isinstance(raw, str) else raw.get("type") if isinstance(raw, dict) else None
    if name not in table:
        raise ConfigError(path, f"unknown {kind} {name!r}; known: {sorted(table)}")
    t = table[name]
    return t.factory(parse_params(t.params, raw if isinstance(raw, dict) else {}, path, ignore))


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
