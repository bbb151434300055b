"""Profile handlers: which profiles run for a request and how their results combine.

`single-profile` runs the one profile; the decode-first P/D handler runs a
decode profile and, when the prompt is mostly uncached there, a prefill one.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from ..pool.endpoints import Endpoint
from .cycle import PREFILL_MISSED, PREFIX_MATCHES
from .plugin_config import param
from .profile import SchedulingProfile
from .types import SchedRequest, SchedulingResult


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

    @classmethod
    def build(cls, p: DisaggParams) -> "DisaggProfileHandler":
        return cls(p.decodeProfile, p.prefillProfile, p.nonCachedTokens, p.promptTokens)

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
