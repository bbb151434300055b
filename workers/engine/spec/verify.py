"""Which proposed tokens a target step accepts.

Greedy rows: the longest prefix of the draft that equals the target's argmax at each
position, then the target's own token (exact: the output is what plain decoding gives).

Sampled rows: the rejection sampling of Leviathan et al. / Chen et al. Draft token x at
position i is kept with probability min(1, p(x) / q(x)); at the first rejection the token
is drawn from the residual norm(max(p - q, 0)); if all k are kept, one more token is drawn
from p at position k. Each emitted token is then distributed exactly as p, the target's
processed distribution (temperature, top-k, top-p as the sampler applies them). A
proposer that drafts deterministically (n-gram lookup, a greedy draft model) has a
one-hot q: keep x with probability p(x), else draw from p with x removed.
"""
from __future__ import annotations

from typing import Sequence as Seq

import torch

from ..api import SamplingParams, TokenLogprob
from ..sampler import GREEDY_EPS, _nucleus


def accept_greedy(draft: Seq[int], target: Seq[int]) -> list[int]:
    """`target[i]` is the target's argmax after the context and draft[:i] (k + 1 of them)."""
    out: list[int] = []
    for d, t in zip(draft, target):
        out.append(t)
        if d != t:
            return out
    out.append(target[len(draft)])
    return out


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Rows of `logits` [n, V] as the sampler's distribution for `p`: tempered, top-k,
    then top-p over the top-k-renormalized mass; each row sums to 1."""
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)
    vocab = probs.shape[-1]
    k = p.top_k if 0 < p.top_k < vocab else vocab
    top_p = p.top_p if 0.0 < p.top_p < 1.0 else 1.0
    if k == vocab and top_p == 1.0:
        return probs
    vals, idx = probs.sort(dim=-1, descending=True)
    vals[:, k:] = 0.0
    if top_p < 1.0:
        cum = vals.cumsum(dim=-1)
        mass = cum[:, -1:] if k < vocab else torch.ones_like(cum[:, -1:])
        vals = _nucleus(vals, cum, top_p * mass)
    out = torch.zeros_like(probs).scatter_(1, idx, vals)
    return out / out.sum(dim=-1, keepdim=True)


def rejection_sample(p: torch.Tensor, draft: Seq[int], q: torch.Tensor | None,
                     gen: torch.Generator | None) -> list[int]:
    """`p` [k + 1, V] target probabilities, `draft` k tokens, `q` [k, V] the draft's
    probabilities (None: one-hot at the draft tokens). Returns the accepted draft
    tokens and one more (1..k + 1 tokens)."""
    k = len(draft)
    u = torch.rand(k + 1, generator=gen)
    out: list[int] = []
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if qx > 0 and float(u[i]) * qx < px:      # u < p(x) / q(x), without dividing
            out.append(int(x))
            continue
        if q is None:
            resid = p[i].clone()
            resid[x] = 0.0
        else:
            resid = (p[i] - q[i]).clamp_(min=0.0)
        total = float(resid.sum())
        if total <= 0.0:          # p == q: cannot reject, but rounding did; p is the answer
            resid, total = p[i], float(p[i].sum())
        out.append(_draw(resid, total, float(u[k])))
        return out
    out.append(_draw(p[k], float(p[k].sum()), float(u[k])))
    return out


def _draw(weights: torch.Tensor, total: float, u: float) -> int:
    cdf = weights.cumsum(0)
    j = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=cdf.dtype), right=True)[0])
    j = min(j, weights.shape[0] - 1)
    while weights[j] <= 0 and j > 0:   # never land on a zero-weight token at the top edge
        j -= 1
    return j


def row_logprobs(logits: torch.Tensor, tokens: Seq[int], n: int) -> list[TokenLogprob]:
    """The sampler's raw logprobs for rows of `logits` and the tokens emitted there."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    chosen = raw.gather(1, torch.tensor([[t] for t in tokens], device=raw.device)).squeeze(1).tolist()
    if n:
        top_v, top_i = raw.topk(n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature <= GREEDY_EPS
