"""Next-token choice for a whole batch in a few tensor ops.

Greedy rows take the argmax. Sampled rows are tempered and drawn by inverting
their CDF at one uniform each: over the whole vocabulary, or, with top-k/top-p,
over the most likely candidates only (a top-k of the probabilities, not a sort of
the vocabulary). Measured at batch 32 on the demo's 49k vocabulary, the
exponential-race draw this replaced (vocabulary-sized noise per row) took 41 ms
a step, 110 ms with top-p (a full sort): as long as the model's own decode
step (docs/benchmarks.md). A request with a seed draws its uniform from its own
generator, one per step, so its tokens do not depend on its neighbours.

`sample` adds what needs each request's history: logit adjustments
(logits_process.py) on the rows that asked for them, and logprobs, taken
from the model's own logits before any adjustment or temperature (vLLM's
default "raw" logprobs), so they describe the model, not the sampling recipe.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence as Seq

import torch

from .api import SamplingParams, TokenLogprob
from .logits_process import adjust_row

GREEDY_EPS = 1e-5  # temperatures at or below are greedy


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(int(seed))


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = make_generator(seed)   # for requests without a seed of their own

    def sample(self, logits: torch.Tensor, params: Seq[SamplingParams],
               generators: Seq[torch.Generator | None], histories: Seq[tuple[Seq[int], int]],
               eos_token_ids: Iterable[int] = (), constraints: Seq[Any] | None = None
               ) -> tuple[list[int], list[TokenLogprob | None]]:
        """As `__call__`, with each row's (prompt + output token ids, prompt length) for
        its adjustments; also returns each row's TokenLogprob (None unless asked for).
        `constraints` (JSON mode, per row or None): a token the row's constraint refuses
        is replaced by the most likely allowed one (greedy) or a draw among them."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = torch.log_softmax(logits[want], dim=-1) if want else None
        adjust = [i for i, p in enumerate(params) if p.adjusts_logits]
        if adjust:
            eos = frozenset(eos_token_ids)
            logits = logits.clone()  # the caller's tensor stays as the model made it
            for i in adjust:
                adjust_row(logits[i], params[i], histories[i][0], histories[i][1], eos)
        tokens = self(logits, params, generators)
        for i, c in enumerate(constraints or ()):
            if c is not None and not c.allows(tokens[i]):
                tokens[i] = self._constrained(logits[i], params[i], generators[i], c, eos_token_ids)
        out: list[TokenLogprob | None] = [None] * len(tokens)
        if raw is not None:
            k = max(params[i].logprobs for i in want)
            top_v, top_i = raw.topk(k, dim=-1) if k else (None, None)
            chosen = raw.gather(1, torch.tensor([[tokens[i]] for i in want])).squeeze(1).tolist()
            for j, i in enumerate(want):
                n = params[i].logprobs
                top = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist())) if n else []
                out[i] = TokenLogprob(tokens[i], chosen[j], top)
        return tokens, out

    def __call__(self, logits: torch.Tensor, params: Seq[SamplingParams],
                 generators: Seq[torch.Generator | None]) -> list[int]:
        """`logits` [n, V] float32, one row per sampling request; returns n token ids."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if p.temperature > GREEDY_EPS]
        if rows:
            picked = self._sample(logits[rows], [params[i] for i in rows],
                                  [generators[i] for i in rows])
            tokens[rows] = picked
        return tokens.tolist()

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        """One uniform per row, inverted through the row's CDF: over the vocabulary in id
        order for untruncated rows, over the kept candidates (most likely first) for
        top-k/top-p rows, so no row draws vocabulary-sized noise or sorts the vocabulary."""
        n, vocab = logits.shape
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        u = self._uniforms(generators)
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        ps = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
        out = torch.empty(n, dtype=torch.int64)
        plain = [i for i in range(n) if ks[i] == vocab and ps[i] == 1.0]
        cut = [i for i in range(n) if ks[i] < vocab or ps[i] < 1.0]
        if plain:
            out[plain] = _invert(probs[plain], u[plain])
        if cut:
            out[cut] = _sample_truncated(probs[cut], u[cut], [ks[i] for i in cut],
                                         [ps[i] for i in cut])
        return out

    def _uniforms(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        """A seeded request takes exactly one draw a step from its own generator, so its
        tokens do not depend on its neighbours; the others share the sampler's."""
        u = torch.rand(len(generators), generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, generator=g)[0]
        return u

    def _constrained(self, row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None,
                     c: Any, eos_token_ids: Iterable[int]) -> int:
        """The token for a constrained row whose first draw was refused. Greedy rows check
        candidates in order of probability, the top 64 first and the rest only if none of
        those fits. Sampled rows draw again from the same (truncated) distribution, up to
        REDRAWS times (rejection sampling: the first allowed draw is an exact draw from the
        masked distribution, and it usually comes at once); failing that, they draw among
        the allowed candidates found until the checked ones hold CHECK_MASS of the
        probability (the unchecked tail is dropped, as top-p drops it); if none of those
        fits, the most likely allowed token of the rest (a schema can leave only tokens
        the model finds unlikely, e.g. the "s" of a key "colors" it wanted to end at
        "color"). No allowed token at all (cannot happen for JSON, whose vocabulary has
        every structural character): EOS, or the unconstrained choice."""
        vocab = row.shape[0]
        if p.temperature <= GREEDY_EPS:
            for t in row.topk(min(64, vocab)).indices.tolist():
                if c.allows(t):
                    return t
            rest = row.topk(vocab).indices.numpy()[64:]
            return next((int(rest[j]) for j in c.prefilter(rest).tolist() if c.allows(int(rest[j]))),
                        next(iter(eos_token_ids), int(row.argmax())))
        vals, idx = torch.softmax(row / p.temperature, dim=-1).sort(descending=True)
        k = p.top_k if 0 < p.top_k < vocab else vocab
        vals[k:] = 0.0
        if 0.0 < p.top_p < 1.0:
            vals[:k] = _nucleus(vals[:k], vals[:k].cumsum(0), p.top_p * (float(vals[:k].sum())
                                                                        if k < vocab else 1.0))
        cdf = vals.cumsum(0)
        draws = torch.rand(REDRAWS, generator=gen or self.generator) * cdf[-1]
        for j in torch.searchsorted(cdf, draws, right=True).clamp_(max=vocab - 1).tolist():
            if vals[j] > 0.0 and c.allows(t := int(idx[j])):
                return t  # redrawn until allowed: an exact draw from the masked distribution
        # the candidates holding CHECK_MASS of the kept mass, those whose first character
        # fits (one vectorised pass), then each checked in full
        checked = min(int(torch.searchsorted(cdf, CHECK_MASS * cdf[-1])) + 1, int((vals > 0).sum()))
        order = idx.numpy()
        ids: list[int] = []
        weights: list[float] = []
        for j in c.prefilter(order[:checked]).tolist():
            if c.allows(t := int(order[j])):
                ids.append(t)
                weights.append(float(vals[j]))
        if not ids:  # a schema can allow only tokens the model finds unlikely
            rest = order[checked:]
            return next((int(rest[j]) for j in c.prefilter(rest).tolist() if c.allows(int(rest[j]))),
                        next(iter(eos_token_ids), int(row.argmax())))
        draw = torch.multinomial(torch.tensor(weights), 1, generator=gen or self.generator)
        return ids[int(draw)]


CHECK_MASS = 0.9999
REDRAWS = 16  # rejection-sampling tries of a refused constrained row before the scan


TOP_P_CANDIDATES = 1024  # top-p looks at this many most likely tokens first (exact: see below)


def _invert(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index where the running sum of `weights` passes u * their total."""
    cdf = weights.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)


def _sample_truncated(probs: torch.Tensor, u: torch.Tensor, ks: list[int], ps: list[float]
                      ) -> torch.Tensor:
    """Top-k, then top-p on the top-k-renormalized distribution (a token is kept while the
    mass ranked strictly ahead of it is below p), as a draw among candidates. Top-p rows
    look at the TOP_P_CANDIDATES most likely tokens; a row whose nucleus might reach past
    them (their mass below p) is redone over its full sort, so the result is exact."""
    n, vocab = probs.shape
    cand = max([k for k in ks if k < vocab] + [TOP_P_CANDIDATES if min(ps) < 1.0 else 1])
    cand = min(vocab, cand)
    vals, idx = probs.topk(cand, dim=-1)
    out = torch.empty(n, dtype=torch.int64)
    redo = []
    for r in range(n):
        k, p = min(ks[r], cand), ps[r]
        v = vals[r, :k]
        if p < 1.0:
            cum = v.cumsum(0)
            if ks[r] == vocab and cand < vocab and float(cum[-1]) < p:
                redo.append(r)               # the nucleus may extend past the candidates
                continue
            v = _nucleus(v, cum, p * (float(cum[-1]) if ks[r] < vocab else 1.0))
        out[r] = idx[r, int(_invert(v.unsqueeze(0), u[r:r + 1])[0])]
    if redo:  # one batched sort (half the time of row by row)
        v, order = probs[redo].sort(dim=-1, descending=True)
        v = _nucleus(v, v.cumsum(dim=-1), torch.tensor([ps[r] for r in redo]).unsqueeze(1))
        pick = _invert(v, u[redo])
        out[redo] = order.gather(1, pick.unsqueeze(1)).squeeze(1)
    return out


def _nucleus(v: torch.Tensor, cum: torch.Tensor, limit) -> torch.Tensor:
    """Top-p on probabilities sorted most likely first (`cum` their running sum): a token
    stays while the mass ranked strictly ahead of it is below `limit` (p times the mass
    top-p renormalizes over); the others become 0."""
    return v * ((cum - v) < limit)
