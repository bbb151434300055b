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

On CUDA (logits on the GPU) the draw runs there: the uniforms still come from the same
CPU generators (one per row, as above, so a seeded request draws the same numbers) and
go to the GPU with the temperatures; top-k/top-p rows take one batched sort of their
distribution instead of the per-row candidate loop (whose exactness check reads a sum
back per row), the same cut computed densely; the sampled ids are read back once. Rows
with adjustments or a constraint's redraw take their rows to the host (both need the
request's history or a tokenizer-side check there).
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence as Seq

import torch

from .api import SamplingParams, TokenLogprob
from .logits_process import adjust_row

GREEDY_EPS = 1e-5  # temperatures at or below are greedy


def plain_greedy(seq: Any) -> bool:
    """Whether a sequence's next token is the bare argmax of its logits (no sampling,
    adjustment, constraint or logprobs), so the runner may pick it without the sampler."""
    p = seq.params
    return p.temperature <= GREEDY_EPS and p.logprobs is None and not p.adjusts_logits \
        and seq.constraint is None


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
            rows = logits[adjust].cpu() if logits.is_cuda else None   # adjustments index on the host
            for j, i in enumerate(adjust):
                adjust_row(logits[i] if rows is None else rows[j], params[i], histories[i][0], histories[i][1], eos)
            if rows is not None:
                logits[adjust] = rows.to(logits.device)
        tokens = self(logits, params, generators)
        for i, c in enumerate(constraints or ()):
            if c is not None and not c.allows(tokens[i]):
                row = logits[i].cpu() if logits.is_cuda else logits[i]
                tokens[i] = self._constrained(row, params[i], generators[i], c, eos_token_ids)
        out: list[TokenLogprob | None] = [None] * len(tokens)
        if raw is not None:
            k = max(params[i].logprobs for i in want)
            top_v, top_i = raw.topk(k, dim=-1) if k else (None, None)
            chosen = raw.gather(1, torch.tensor([[tokens[i]] for i in want], device=raw.device)).squeeze(1).tolist()
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
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(dev, non_blocking=True)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        u = self._uniforms(generators).to(dev, non_blocking=True)
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        ps = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
        out = torch.empty(n, dtype=torch.int64, device=dev)
        plain = [i for i in range(n) if ks[i] == vocab and ps[i] == 1.0]
        cut = [i for i in range(n) if ks[i] < vocab or ps[i] < 1.0]
        if plain:
            out[plain] = _invert(probs[plain], u[plain])
        if cut:
            truncated = _sample_truncated_dense if logits.is_cuda else _sample_truncated
            out[cut] = truncated(probs[cut], u[cut], [ks[i] for i in cut], [ps[i] for i in cut])
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


def _sample_truncated_dense(probs: torch.Tensor, u: torch.Tensor, ks: list[int], ps: list[float]
                            ) -> torch.Tensor:
    """`_sample_truncated` without a host round trip per row (the GPU's form): every row's
    distribution sorted once (a batched GPU sort of the vocabulary costs less than one
    read-back), then the same cut as masks: ranks past k zeroed, top-p on the
    top-k-renormalized mass, the draw inverted over what is kept."""
    n, vocab = probs.shape
    dev = probs.device
    k_t = torch.tensor(ks, dtype=torch.int64).to(dev, non_blocking=True).unsqueeze(1)
    p_t = torch.tensor(ps, dtype=torch.float32).to(dev, non_blocking=True).unsqueeze(1)
    kmax = min(vocab, max(k if p == 1.0 else vocab for k, p in zip(ks, ps)))
    if kmax < vocab:
        vals, idx = probs.topk(kmax, dim=-1)
    else:
        vals, idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vals.shape[1], device=dev).unsqueeze(0)
    v = vals * (rank < k_t)
    cum = v.cumsum(dim=-1)
    mass = torch.where(k_t < vocab, cum[:, -1:], torch.ones_like(cum[:, -1:]))
    v = torch.where(p_t < 1.0, _nucleus(v, cum, p_t * mass), v)
    kept = (v > 0).sum(dim=-1).clamp_(min=1)
    cdf = v.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    pick = torch.minimum(pick, kept - 1)
    return idx.gather(1, pick.unsqueeze(1)).squeeze(1)


def _nucleus(v: torch.Tensor, cum: torch.Tensor, limit) -> torch.Tensor:
    """Top-p on probabilities sorted most likely first (`cum` their running sum): a token
    stays while the mass ranked strictly ahead of it is below `limit` (p times the mass
    top-p renormalizes over); the others become 0."""
    return v * ((cum - v) < limit)
