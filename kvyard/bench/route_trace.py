"""Public trace formats for `kvyard bench route`, and the ideal cache's hit rate.

- Mooncake (FAST'25) JSONL: one request a line, `{"timestamp": ms since the first
  request, "input_length", "output_length", "hash_ids": [...]}`; each hash id is a
  512-token block and equal ids at equal positions mean a shared prefix.
- Azure LLM inference trace CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`; it says
  nothing of content, so every prompt is unique.

Both become `RouteRequest`s whose segments reproduce the sharing: a Mooncake block
is one segment seeded by its hash id (a shorter last block is a prefix of the same
tokens). `ideal_hit_rate` is what one infinite prefix cache at the engine's block
size would hit on the same requests in the same order.
"""
from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Iterable, Sequence

from kvyard.bench.route_workload import RouteRequest, Segment, SharedPrefix, arrivals
from kvyard.common.hashing import block_hashes

MOONCAKE_BLOCK = 512
ENGINE_BLOCK = 16  # the engine's (and the simulator's) KV block size
# Disjoint seed ranges: trace blocks, unhashed tails, Azure prompts (all deterministic).
_TRACE_SEED, _TAIL_SEED, _AZURE_SEED = 1 << 40, 2 << 40, 3 << 40


def read_mooncake(path: Path, speedup: float = 1.0, limit: int | None = None
                  ) -> list[RouteRequest]:
    out: list[RouteRequest] = []
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            n, hashes = int(rec["input_length"]), [int(h) for h in rec.get("hash_ids", [])]
            segs, left = [], n
            for h in hashes:
                if left <= 0:
                    break
                take = min(MOONCAKE_BLOCK, left)
                segs.append(Segment(_TRACE_SEED + h, take))
                left -= take
            if left > 0:  # longer than its hash ids say: the rest is unique to this request
                segs.append(Segment(_TAIL_SEED + len(out), left))
            out.append(RouteRequest(float(rec.get("timestamp", 0)) / 1000 / speedup, tuple(segs),
                                    max(1, int(rec.get("output_length", 1)))))
            if limit is not None and len(out) >= limit:
                break
    return out


def _azure_time(s: str) -> float:
    s = s.strip()
    try:
        return float(s)
    except ValueError:
        pass
    # "2023-11-16 18:15:46.6805900": seven fractional digits, more than %f takes.
    head, _, frac = s.partition(".")
    t = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return t + (float("0." + frac) if frac else 0.0)


def read_azure(path: Path, speedup: float = 1.0, limit: int | None = None) -> list[RouteRequest]:
    out: list[RouteRequest] = []
    t0 = None
    with open(path, newline="") as fh:
        for i, row in enumerate(csv.DictReader(fh)):
            t = _azure_time(row["TIMESTAMP"])
            t0 = t if t0 is None else t0
            seg = Segment(_AZURE_SEED + i, max(1, int(row["ContextTokens"])))
            out.append(RouteRequest((t - t0) / speedup, (seg,),
                                    max(1, int(row["GeneratedTokens"]))))
            if limit is not None and len(out) >= limit:
                break
    return out


def read_trace(path: Path, speedup: float = 1.0, limit: int | None = None) -> list[RouteRequest]:
    """By extension: .jsonl is Mooncake's format, .csv Azure's."""
    if path.suffix == ".csv":
        return read_azure(path, speedup, limit)
    return read_mooncake(path, speedup, limit)


def synthetic_mooncake(n: int, rate: float, seed: int = 0, groups: int = 8,
                       prefix_blocks: int = 4, max_tail_blocks: int = 6) -> list[dict]:
    """Mooncake-format records with shared-prefix groups: each request is one group's
    prefix blocks then blocks of its own, hash ids numbered as Mooncake numbers them
    (each new block the next integer)."""
    rng = random.Random(seed)
    next_id = 0
    prefixes = []
    for _ in range(groups):
        prefixes.append(list(range(next_id, next_id + prefix_blocks)))
        next_id += prefix_blocks
    recs = []
    for at in arrivals(n, rate, rng):
        tail = rng.randint(1, max_tail_blocks)
        ids = prefixes[rng.randrange(groups)] + list(range(next_id, next_id + tail))
        next_id += tail
        length = (len(ids) - 1) * MOONCAKE_BLOCK + rng.randint(1, MOONCAKE_BLOCK)
        recs.append({"timestamp": int(at * 1000), "input_length": length,
                     "output_length": rng.randint(16, 256), "hash_ids": ids})
    return recs


@dataclass(slots=True)
class IdealCache:
    """One infinite prefix cache that sees every request in arrival order, its hits
    counted as vLLM's prefix-cache counters count them: leading full blocks already
    seen, never the whole prompt (the last token is always computed). `feed` again
    to continue with the cache as it was (a rate ladder's next rung)."""

    vocab_ids: Sequence[int]
    block: int = ENGINE_BLOCK
    seen: set[int] = field(default_factory=set)
    _ids: dict[Segment, list[int]] = field(default_factory=dict)

    def feed(self, requests: Iterable[RouteRequest]) -> float:
        """Hit tokens / prompt tokens over `requests`."""
        hits = queries = 0
        for r in sorted(requests, key=lambda r: r.at_s):
            ids: list[int] = []
            for s in r.segments:
                got = self._ids.get(s)
                if got is None:
                    got = self._ids[s] = s.ids(self.vocab_ids)
                ids += got
            hashes = block_hashes(ids, self.block)
            matched = 0
            for h in hashes:
                if h not in self.seen:
                    break
                matched += 1
            hits += min(matched * self.block, ((len(ids) - 1) // self.block) * self.block)
            queries += len(ids)
            self.seen.update(hashes)
        return hits / queries if queries else 0.0


def ideal_hit_rate(requests: Iterable[RouteRequest], vocab_ids: Sequence[int],
                   block: int = ENGINE_BLOCK) -> float:
    return IdealCache(vocab_ids, block).feed(requests)


def demand_tokens(shape: SharedPrefix | None, requests: Sequence[RouteRequest]) -> int:
    """Distinct prompt tokens: the cache the workload asks the pool for."""
    if shape is not None:
        return shape.unique_tokens()
    seen: dict[int, int] = {}
    for r in requests:
        for s in r.segments:
            seen[s.seed] = max(seen.get(s.seed, 0), s.length)
    return sum(seen.values())
