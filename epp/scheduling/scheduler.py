"""The scheduling step of a request: the profile handler runs its profiles
(filters → weighted scorers → picker), then each picking profile's
`PreRequest` hooks; `learn` and `forget` reach the `PostResponse` and
`PoolListener` plugins. Built from YAML by `config.build_scheduler`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Iterator, TypeVar

from ..pool.endpoints import Endpoint
from .cycle import PREFIX_MATCHES
from .handlers import ProfileHandler
from .hooks import HOOKS, Filter, PoolListener, PostResponse, PreRequest, Scorer
from .profile import SchedulingProfile
from .types import Decision, SchedRequest, SchedulingResult

H = TypeVar("H")


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
    # Which hook protocols each plugin class implements, looked up once per class: a
    # runtime-checkable isinstance costs microseconds, too much per request.
    _implements: dict[type, tuple[type, ...]] = field(default_factory=dict)

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
        """The primary profile's prefix-cache scorer, or the one a precise-prefix-cache
        scorer uses for endpoints without events (for tests and debugging)."""
        return next((s if s.name == "prefix-cache" else s.fallback for s, _ in self.scorers
                     if s.name in ("prefix-cache", "precise-prefix-cache")), None)

    def _is(self, plugin: object, hook: type[H]) -> bool:
        kinds = self._implements.get(type(plugin))
        return hook in (kinds if kinds is not None else self._learn_kinds(plugin))

    def _learn_kinds(self, plugin: object) -> tuple[type, ...]:
        kinds = self._implements[type(plugin)] = tuple(h for h in HOOKS if isinstance(plugin, h))
        return kinds

    def _all(self, hook: type[H]) -> Iterator[H]:
        """Every plugin of every profile implementing `hook`, each once."""
        seen: set[int] = set()
        for prof in self.profiles.values():
            for p in prof.plugins():
                if id(p) not in seen and self._is(p, hook):
                    seen.add(id(p))
                    yield p  # type: ignore[misc]

    def candidates(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        """The primary profile's filtered pool (what saturation is measured on)."""
        return self.primary.candidates(req, eps)

    def schedule(self, req: SchedRequest, eps: list[Endpoint]) -> Decision | None:
        """The handler's result as a Decision (None: no endpoint), pre-request hooks run."""
        result = self.handler.run(req, self.profiles, eps, self.rng)
        if result is None:
            return None
        self.pre_request(req, result)
        return self._decision(req, result)

    def pre_request(self, req: SchedRequest, result: SchedulingResult) -> None:
        """Each profile's `PreRequest` plugins see that profile's pick, which is then counted."""
        implements = self._implements
        for name, r in result.results.items():
            picked = r.endpoints[0]
            for p in self.profiles[name].plugins():
                kinds = implements.get(type(p))
                if PreRequest in (kinds if kinds is not None else self._learn_kinds(p)):
                    p.pre_request(req, picked)  # type: ignore[attr-defined]
            count_pick(req, picked)

    @staticmethod
    def _decision(req: SchedRequest, result: SchedulingResult) -> Decision:
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
        for p in self._all(PostResponse):
            p.learn(address, hashes)

    def forget(self, address: str) -> None:
        """An endpoint left the pool: drop what plugins believed about it."""
        for p in self._all(PoolListener):
            p.forget(address)
