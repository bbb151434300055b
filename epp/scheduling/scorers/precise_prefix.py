"""The precise prefix-cache scorer: the longest prefix of the prompt each endpoint
really holds, from its KV events (`epp/kvevents/`).

Per endpoint, the request's own keys at that endpoint's engine block size are walked
from the first block while the endpoint holds them; each held block counts by its
best medium (GPU 1, CPU 0.8, kvstore/disk 0.5), and the score is that sum over the
prompt's blocks. The walk stops for an endpoint at its first miss and for the
request when no endpoint is left, tokenizing the prompt only that far. Matches are
written to `PREFIX_MATCHES` (in the prompt's blocks), so the P/D decider and the
pick's hit count read them as they read the approximate scorer's.

Its own picks count as held (speculative entries, `speculativeTTL`) until events
confirm them, so a burst of one prefix sticks to one endpoint from the start.
Endpoints with no event stream are scored as `prefix-cache` scores them (an
approximate index of its own, fed by its picks), so a pool where only some
workers publish routes as before for the others. The `kvyard epp` app feeds the
index (`kvevents/sources.py`).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ...kvevents.index import DEFAULT_MAX_BYTES, KVBlockIndex, best_weight, key_seed
from ...kvevents.request_keys import EngineKeys
from ...kvevents.speculative import Speculative
from ...pool.endpoints import Endpoint
from ..cycle import PREFIX_MATCHES, StateKey
from ..hooks import PoolListener, PostResponse, PreRequest, Scorer
from ..plugin_config import param
from ..prefix_index import PrefixIndex
from ..types import SchedRequest
from .prefix_cache import PrefixCacheScorer

_NONE: dict = {}
# This request's engine-block-size keys, by block size (shared by score and pre_request).
ENGINE_KEYS: StateKey[dict[int, EngineKeys]] = StateKey("precise-prefix-cache/engine-keys")


@dataclass(slots=True, frozen=True)
class PrecisePrefixParams:
    speculativeTTL: float = param(2.0, min=0.0, doc="seconds a pick counts as cached before "
                                                    "its events arrive (0: off)")
    maxIndexBytes: int = param(DEFAULT_MAX_BYTES, min=1 << 20,
                               doc="memory budget of the block index (LRU past it)")
    blockSize: int = param(16, min=1, doc="engine block size assumed before an endpoint's "
                                          "events or metrics tell it")
    lruCapacityPerServer: int = param(31_250, min=1, doc="endpoints without events: as "
                                                         "prefix-cache's parameter")


@dataclass(slots=True)
class PrecisePrefixScorer(Scorer, PreRequest, PostResponse, PoolListener):
    """Longest consecutive prefix each endpoint holds per its KV events (medium-weighted)
    / prompt blocks; the EPP's own picks count until events confirm them."""

    index: KVBlockIndex = field(default_factory=KVBlockIndex)
    speculative: Speculative = field(default_factory=Speculative)
    default_block_size: int = 16
    fallback: PrefixCacheScorer = field(default_factory=lambda: PrefixCacheScorer(PrefixIndex()))
    name: str = "precise-prefix-cache"
    _pending: deque = field(default_factory=deque)  # (expiry, keys view, address): not yet whole

    @classmethod
    def build(cls, p: PrecisePrefixParams) -> "PrecisePrefixScorer":
        return cls(KVBlockIndex(p.maxIndexBytes), Speculative(p.speculativeTTL), p.blockSize,
                   PrefixCacheScorer(PrefixIndex(p.lruCapacityPerServer)))

    def _block_size(self, ep: Endpoint) -> int:
        return self.index.block_size.get(ep.address) or ep.block_size or self.default_block_size

    def _keys(self, req: SchedRequest, bs: int) -> EngineKeys:
        views = req.cycle.read(ENGINE_KEYS)
        if views is None:
            req.cycle.write(ENGINE_KEYS, views := {})
        v = views.get(bs)
        if v is None:
            v = views[bs] = EngineKeys(req.prompt, bs, seed=key_seed(req.adapter or None))
        return v

    def score(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        live = self.index.subscribed
        if all(e.address in live for e in eps):
            return self._precise(req, eps)
        out = [0.0] * len(eps)
        split = ([i for i, e in enumerate(eps) if e.address in live],
                 [i for i, e in enumerate(eps) if e.address not in live])
        for idxs, fn in zip(split, (self._precise, self.fallback.score)):
            if idxs:
                for i, v in zip(idxs, fn(req, [eps[i] for i in idxs])):
                    out[i] = v
        return out

    def _precise(self, req: SchedRequest, eps: list[Endpoint]) -> list[float]:
        now = time.monotonic()
        spec = self.speculative
        spec.purge(now)
        by_bs: dict[int, list[int]] = {}
        for i, e in enumerate(eps):
            by_bs.setdefault(self._block_size(e), []).append(i)
        weighted = [0.0] * len(eps)
        matched = [0] * len(eps)
        totals = [0] * len(eps)
        for bs, idxs in by_bs.items():
            view = self._keys(req, bs)
            alive = {eps[i].address: i for i in idxs}
            n = 0
            while alive:
                key = view.get(n)
                if key is None:
                    break
                hs = self.index.holders_of(key) or _NONE
                sp = (spec.holders(key, now) if len(spec) else None) or _NONE
                # only endpoints holding this block go on: iterate the smaller side, so a
                # long prompt over many endpoints costs blocks × holders, not × endpoints
                nxt: dict[str, int] = {}
                for addr in (alive if len(alive) <= len(hs) + len(sp) else (*hs, *sp)):
                    i = alive.get(addr)
                    if i is None or addr in nxt:
                        continue
                    cur = hs.get(addr)
                    if cur is not None:
                        w = best_weight(cur[0])
                        if addr in sp:
                            spec.confirm(key, addr)
                    else:
                        w = 1.0 if addr in sp else 0.0
                    if w:
                        nxt[addr] = i
                        weighted[i] += w
                        matched[i] = n + 1
                alive = nxt
                n += 1
            total = view.estimated_blocks()
            seen = req.cycle.read(PREFIX_MATCHES)
            if seen is None:
                req.cycle.write(PREFIX_MATCHES, seen := {})
            for i in idxs:
                totals[i] = max(total, matched[i])
                addr = eps[i].address
                seen[addr] = max(seen.get(addr, 0), view.prompt_blocks(matched[i]))
        return [w / t if t else 0.0 for w, t in zip(weighted, totals)]

    def pre_request(self, req: SchedRequest, ep: Endpoint) -> None:
        if ep.address not in self.index.subscribed:
            self.fallback.pre_request(req, ep)
            return
        if self.speculative.ttl <= 0:
            return
        view = self._keys(req, self._block_size(ep))
        now = time.monotonic()
        while self._pending and self._pending[0][0] <= now:
            self._pending.popleft()
        expiry = now + self.speculative.ttl
        self.speculative.add(view.known(), ep.address, expiry)
        if not req.prompt.done:  # the rest is tokenized after the answer (`learn`)
            self._pending.append((expiry, view, ep.address))

    def learn(self, address: str, hashes: list[int]) -> None:
        """The finisher tokenized a routed prompt whole: its speculative entries cover
        all of it now."""
        if address not in self.index.subscribed:
            self.fallback.learn(address, hashes)
            return
        now = time.monotonic()
        keep = []
        for item in self._pending:
            expiry, view, addr = item
            if expiry <= now:
                continue
            if addr == address and view.prompt.done:
                self.speculative.add(view.known(), addr, expiry)
            else:
                keep.append(item)
        self._pending = deque(keep)

    def forget(self, address: str) -> None:
        self.fallback.forget(address)
        self.index.forget(address)
        self.speculative.forget(address)
