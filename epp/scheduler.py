"""filters → weighted scorers → picker, assembled from a small YAML config.

    filters: [healthy, prefer-fresh, role]
    scorers:
      - {type: prefix-cache, weight: 3, blockSize: 64, lruCapacityPerServer: 31250}
      - {type: queue, weight: 2}
      - {type: kv-cache-utilization, weight: 2}
    picker: {type: max-score}          # random tie-break
    objectives: {batch: -1}            # x-gateway-inference-objective -> priority

Names follow the reference EPP so configs read the same. The picker only
knows totals; scorers only know their own signal.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .endpoints import Endpoint
from .plugins import FILTERS, SCORERS, Filter, PrefixCacheScorer, SchedRequest, Scorer
from .prompt import LazyPrompt

DEFAULT_CONFIG: dict[str, Any] = {
    "filters": ["healthy", "prefer-fresh", "role"],
    "scorers": [
        {"type": "prefix-cache", "weight": 3, "blockSize": 64, "lruCapacityPerServer": 31_250},
        {"type": "queue", "weight": 2},
        {"type": "kv-cache-utilization", "weight": 2},
    ],
    "picker": {"type": "max-score"},
    "objectives": {},
}


@dataclass(slots=True)
class Decision:
    endpoint: Endpoint
    score: float
    matched_blocks: int
    total_blocks: int  # estimated until the prompt is fully hashed
    candidates: int
    prompt: LazyPrompt | None = None


@dataclass(slots=True)
class Scheduler:
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    block_size: int = 64
    objectives: dict[str, int] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)

    @property
    def prefix_scorer(self) -> PrefixCacheScorer | None:
        for s, _ in self.scorers:
            if isinstance(s, PrefixCacheScorer):
                return s
        return None

    def candidates(self, req: SchedRequest, eps: list[Endpoint]) -> list[Endpoint]:
        for f in self.filters:
            if not eps:
                break
            eps = f.filter(req, eps)
        return eps

    def schedule(self, req: SchedRequest, eps: list[Endpoint]) -> Decision | None:
        """Picks one endpoint (max total score, random among ties) or None."""
        eps = self.candidates(req, eps)
        if not eps:
            return None
        totals = [0.0] * len(eps)
        for scorer, weight in self.scorers:
            for i, s in enumerate(scorer.score(req, eps)):
                totals[i] += weight * s
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if best - t <= 1e-9]
        i = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        ep = eps[i]
        for scorer, _ in self.scorers:
            scorer.on_pick(req, ep)
        ep.picks += 1
        ep.pending += 1
        matched = req.matched.get(ep.address, 0)
        if matched:
            ep.prefix_hits += 1
        total = max(req.prompt.estimated_blocks(), matched)
        return Decision(ep, best, matched, total, len(eps), req.prompt)

    def learn(self, address: str, hashes: list[int]) -> None:
        """The whole prompt of a request routed to `address`, once hashed."""
        ps = self.prefix_scorer
        if ps is not None and hashes:
            ps.index.record(address, hashes)

    def forget(self, address: str) -> None:
        """An endpoint left the pool: drop what we believed it cached."""
        ps = self.prefix_scorer
        if ps is not None:
            ps.index.remove(address)


def build_scheduler(cfg: dict[str, Any] | None = None, seed: int | None = None) -> Scheduler:
    cfg = {**DEFAULT_CONFIG, **(cfg or {})}
    filters = []
    for f in cfg.get("filters") or []:
        name = f if isinstance(f, str) else f.get("type")
        if name not in FILTERS:
            raise ValueError(f"unknown filter {name!r}; known: {sorted(FILTERS)}")
        filters.append(FILTERS[name](f if isinstance(f, dict) else {}))
    scorers: list[tuple[Scorer, float]] = []
    block_size = 64
    for s in cfg.get("scorers") or []:
        name = s.get("type")
        if name not in SCORERS:
            raise ValueError(f"unknown scorer {name!r}; known: {sorted(SCORERS)}")
        weight = float(s.get("weight", 1))
        if weight:
            scorers.append((SCORERS[name](s), weight))
        if name == "prefix-cache":
            block_size = int(s.get("blockSize", 64))
    picker = (cfg.get("picker") or {}).get("type", "max-score")
    if picker != "max-score":
        raise ValueError(f"unknown picker {picker!r}; known: ['max-score']")
    objectives = {str(k): int(v) for k, v in (cfg.get("objectives") or {}).items()}
    return Scheduler(filters, scorers, block_size, objectives, random.Random(seed))


def load_config(path: str | Path | None) -> dict[str, Any]:
    if not path:
        return dict(DEFAULT_CONFIG)
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: scheduler config must be a mapping")
    return data
