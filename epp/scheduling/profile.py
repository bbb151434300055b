"""Scheduling profiles, pickers and profile handlers (GAIE/llm-d's shape).

A profile is filters → weighted scorers → picker over the pool; its result
is an ordered list of endpoints (the pick first, then fallbacks). A profile
handler decides which profiles run for a request and combines their results:
`single-profile` runs the one profile; the decode-first P/D handler runs a
decode profile and, when the prompt is mostly uncached there, a prefill one.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from ..pool.endpoints import Endpoint
from .cycle import PREFILL_MISSED, PREFIX_MATCHES
from .plugin_config import param
from .plugins import Filter, PluginType, SchedRequest, Scorer


@dataclass(slots=True, frozen=True)
class MaxScoreParams:
    maxEndpoints: int = param(1, min=1, max=16,
                              doc="endpoints returned: the pick, then fallbacks by score")


@dataclass(slots=True)
class MaxScorePicker:
    """The highest total score, random among ties; then the rest best first."""

    max_endpoints: int = 1
    name: str = "max-score"

    def pick(self, totals: list[float], rng: random.Random) -> list[int]:
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if best - t <= 1e-9]
        first = tied[0] if len(tied) == 1 else rng.choice(tied)
        if self.max_endpoints == 1:
            return [first]
        rest = sorted((i for i in range(len(totals)) if i != first), key=lambda i: -totals[i])
        return [first, *rest[: self.max_endpoints - 1]]


class Picker(Protocol):
    name: str

    def pick(self, totals: list[float], rng: random.Random) -> list[int]: ...


PICKERS: dict[str, PluginType] = {
    "max-score": PluginType(lambda p: MaxScorePicker(p.maxEndpoints), MaxScoreParams,
                            MaxScorePicker.__doc__ or ""),
}


@dataclass(slots=True)
class ProfileResult:
    endpoints: list[Endpoint]  # the pick first, then fallbacks
    score: float               # the pick's total score
    candidates: int            # endpoints left after the filters


@dataclass(slots=True)
class SchedulingProfile:
    name: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker = field(default_factory=MaxScorePicker)

    def plugins(self) -> list[object]:
        return [*self.filters, *(s for s, _ in self.scorers), self.picker]

    def candidates(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        for f in self.filters:
            if not eps:
                break
            eps = f.filter(req, eps)
        return eps

    def run(self, req: SchedRequest, eps: list[Endpoint],
            rng: random.Random) -> ProfileResult | None:
        eps = self.candidates(req, eps)
        if not eps:
            return None
        totals = [0.0] * len(eps)
        for scorer, weight in self.scorers:
            for i, s in enumerate(scorer.score(req, eps)):
                totals[i] += weight * s
        order = self.picker.pick(totals, rng)
        return ProfileResult([eps[i] for i in order], totals[order[0]], len(eps))


@dataclass(slots=True)
class SchedulingResult:
    results: dict[str, ProfileResult]
    primary: str  # the profile whose pick is the request's destination


class ProfileHandler(Protocol):
    name: str

    def primary(self, profiles: dict[str, SchedulingProfile]) -> str: ...

    def run(self, req: SchedRequest, profiles: dict[str, SchedulingProfile],
            eps: list[Endpoint], rng: random.Random) -> SchedulingResult | None: ...


@dataclass(slots=True)
class SingleProfileHandler:
    """Runs the one configured profile; its pick is the destination."""

    name: str = "single-profile"

    def primary(self, profiles: dict[str, SchedulingProfile]) -> str:
        return next(iter(profiles))

    def run(self, req: SchedRequest, profiles: dict[str, SchedulingProfile],
            eps: list[Endpoint], rng: random.Random) -> SchedulingResult | None:
        name = self.primary(profiles)
        r = profiles[name].run(req, eps, rng)
        return None if r is None else SchedulingResult({name: r}, name)


@dataclass(slots=True, frozen=True)
class DisaggParams:
    decodeProfile: str = param("decode", doc="the profile whose pick is the destination")
    prefillProfile: str = param("prefill", doc="the profile that picks the prefill pod")
    nonCachedTokens: int = param(256, min=0, doc="disaggregate when at least this many prompt "
                                                  "tokens are not cached on the decode pick")
    promptTokens: int = param(0, min=0, doc="... and the prompt has at least this many tokens")


@dataclass(slots=True)
class DisaggProfileHandler:
    """Decode first (llm-d's disagg-profile-handler with its prefix-based decider):
    the decode profile picks the destination; if the prompt's tokens not
    cached there reach `nonCachedTokens`, the prefill profile picks a prefill
    pod (`x-prefiller-host-port`). No prefill pick, or the same pod: no header,
    the decode pod prefills itself."""

    decode: str = "decode"
    prefill: str = "prefill"
    non_cached_tokens: int = 256
    prompt_tokens: int = 0
    name: str = "disagg-profile-handler"

    def primary(self, profiles: dict[str, SchedulingProfile]) -> str:
        return self.decode

    def run(self, req: SchedRequest, profiles: dict[str, SchedulingProfile],
            eps: list[Endpoint], rng: random.Random) -> SchedulingResult | None:
        d = profiles[self.decode].run(req, eps, rng)
        if d is None:
            return None
        out = SchedulingResult({self.decode: d}, self.decode)
        bs = req.prompt.block_size
        total = req.prompt.estimated_blocks() * bs
        matched = req.cycle.read(PREFIX_MATCHES, {}).get(d.endpoints[0].address, 0) * bs
        if total < max(self.prompt_tokens, 1) or total - matched < self.non_cached_tokens:
            return out
        others = [e for e in eps if e is not d.endpoints[0]]
        p = profiles[self.prefill].run(req, others, rng)
        if p is not None:
            out.results[self.prefill] = p
        else:
            req.cycle.write(PREFILL_MISSED, True)
        return out


PROFILE_HANDLERS: dict[str, PluginType] = {
    "single-profile": PluginType(lambda p: SingleProfileHandler(),
                                 doc=SingleProfileHandler.__doc__ or ""),
    "disagg-profile-handler": PluginType(
        lambda p: DisaggProfileHandler(p.decodeProfile, p.prefillProfile, p.nonCachedTokens,
                                       p.promptTokens), DisaggParams,
        DisaggProfileHandler.__doc__ or ""),
}
