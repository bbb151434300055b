"""Speculative decoding inside `LLMEngine.step`: drafts before the target step, verification after.

`plan` (after `Scheduler.schedule`): each eligible decode row gets a draft of up to k
tokens (policy.py decides who drafts), the slots for its 1 + k positions are reserved
without preempting anyone (no room or token budget: it decodes plainly), and the batch
is reordered to plain decodes, speculative rows, prefill chunks. The runner then feeds
a speculative row its last token and the draft (a small extend: k + 1 query positions
over the paged cache) and returns a logits row (or a greedy-screened token) for each of
those positions: the sequence appears k + 1 times among the samplers.

`sample` (instead of the engine's plain sampling): other rows sample as usual; each
speculative row accepts a prefix of its draft (verify.py) and yields 1..k + 1 tokens. The
flattened result goes to `Scheduler.postprocess`, which appends them one by one (stops,
max_tokens, logprobs, streaming as for plain decoding) and rolls the sequence back to
what was verified: `num_computed_tokens` stops before the last emitted token, blocks past
it are released, and only verified full blocks reach the prefix cache, KV events, the
connector and P/D holds.

Eligible: a decode without logit adjustments (penalties, bias, min_tokens: they depend
on the history each draft position would change), without guided decoding, not a P/D
prefill; with room for at least one more token under max_tokens and max_model_len.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..scheduler import SchedulerOutput
from ..sequence import Sequence
from .config import SpeculativeConfig
from .ngram import NgramProposer
from .policy import SpecPolicy, SpecState
from .stats import SpecDecodeStats
from .verify import accept_greedy, is_greedy, rejection_sample, row_logprobs, target_probs

SampleFn = Callable[[torch.Tensor | None, list[Sequence], list[int] | None], tuple[list[int], list]]


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, block_manager: Any, max_num_batched_tokens: int,
                 max_model_len: int, draft: Any = None, generator: torch.Generator | None = None) -> None:
        """`draft`: a draft.DraftProposer for method draft_model; `generator`: the
        sampler's, for requests without a seed of their own."""
        self.cfg = cfg
        self.k = cfg.num_speculative_tokens
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(cfg) if cfg.method == "ngram" else None
        self.draft = draft
        self.policy = SpecPolicy(cfg)
        self.stats = SpecDecodeStats()
        self.generator = generator
        self._step: tuple[int, bool, int] | None = None  # a decode step's (rows, drafted, tokens out)

    # ---- before the target step ------------------------------------------------
    def plan(self, sched: SchedulerOutput) -> None:
        budget = self.max_num_batched_tokens - sched.num_tokens
        nd = sched.num_decodes
        pure = nd == len(sched.seqs)       # decodes only: a step the gate learns from
        self._step = (nd, False, nd) if pure else None
        if pure and not self.policy.step_allows(nd):
            return
        cands: list[tuple[Sequence, int]] = []
        for seq in sched.seqs[:nd]:
            k = self._room(seq)
            if k and budget > 0:
                if seq.spec is None:
                    seq.spec = SpecState(preemptions=seq.num_preemptions)
                if self.policy.wants_draft(seq.spec):
                    cands.append((seq, min(k, budget)))
                    budget -= min(k, budget)
        if not cands:
            return
        drafts: dict[str, list[int]] = {}
        if self.ngram is not None:
            for seq, k in cands:
                d = self.ngram.propose(seq.token_ids, k)
                if d and self.bm.allocate(seq, 1 + len(d)):
                    drafts[seq.request_id] = d
        else:
            ok = [(s, k) for s, k in cands if self.bm.allocate(s, 1 + k)]
            if ok:
                for (s, _), d in zip(ok, self.draft.propose([s for s, _ in ok], [k for _, k in ok])):
                    drafts[s.request_id] = d
        if not drafts:
            return
        plain, spec = [], []
        for seq in sched.seqs[:nd]:
            d = drafts.get(seq.request_id)
            if d:
                seq.spec_token_ids = d
                spec.append((seq, 1 + len(d)))
            else:
                plain.append((seq, 1))
        rest = list(zip(sched.seqs[nd:], sched.num_new_tokens[nd:]))
        pairs = plain + spec + rest
        sched.seqs = [s for s, _ in pairs]
        sched.num_new_tokens = [n for _, n in pairs]
        sched.num_decodes = len(plain)
        if pure:
            self._step = (nd, True, nd)

    def observe(self, seconds: float) -> None:
        """The step's time and output, for the policy's gate (decode steps only)."""
        if self._step is not None:
            rows, drafted, emitted = self._step
            self.policy.gate.observe(rows, drafted, emitted, seconds)

    def _room(self, seq: Sequence) -> int:
        p = seq.params
        if p.adjusts_logits or seq.constraint is not None or seq.hold_kv:
            return 0
        return max(0, min(self.k, p.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens))

    # ---- after the target step -------------------------------------------------
    def sample(self, sample: SampleFn, logits: torch.Tensor | None, samplers: list[Sequence],
               picked: list[int] | None) -> tuple[list[Sequence], list[int], list]:
        """Tokens for every sampling row: plain rows through `sample` (the engine's), each
        speculative sequence's k + 1 rows verified into its accepted tokens. Returns the
        flattened (sequence, token, logprob) rows for postprocess."""
        # logits row of each sampler row (None where the runner picked the token)
        where: list[int | None] = list(range(len(samplers))) if picked is None else []
        if picked is not None:
            j = 0
            for tok in picked:
                where.append(None if tok >= 0 else j)
                j += tok < 0
        groups: list[tuple[int, int]] = []   # (first row, rows) per sequence, in order
        i = 0
        while i < len(samplers):
            n = 1 + len(samplers[i].spec_token_ids)
            groups.append((i, n))
            i += n
        plain = [r for r, n in groups if n == 1]
        plain_out: dict[int, tuple[int, Any]] = {}
        if plain:
            lrows = [where[r] for r in plain if where[r] is not None]
            sub = logits[torch.tensor(lrows, device=logits.device)] if lrows else None
            sub_picked = None if picked is None else [picked[r] for r in plain]
            toks, lps = sample(sub, [samplers[r] for r in plain], sub_picked)
            plain_out = {r: (t, lp) for r, t, lp in zip(plain, toks, lps)}
        seqs: list[Sequence] = []
        tokens: list[int] = []
        lps_out: list = []
        for r, n in groups:
            seq = samplers[r]
            if n == 1:
                t, lp = plain_out[r]
                seqs.append(seq), tokens.append(t), lps_out.append(lp)
                continue
            toks, lps = self._verify(seq, logits, picked, where[r:r + n], r)
            seqs += [seq] * len(toks)
            tokens += toks
            lps_out += lps
        if self._step is not None:
            self._step = (self._step[0], True, len(tokens))
        return seqs, tokens, lps_out

    def _verify(self, seq: Sequence, logits: torch.Tensor | None, picked: list[int] | None,
                where: list[int | None], r0: int) -> tuple[list[int], list]:
        draft = seq.spec_token_ids
        p = seq.params
        rows = [w for w in where if w is not None]
        lg = logits[torch.tensor(rows, device=logits.device)] if rows else None
        if is_greedy(p):
            if lg is None:
                target = picked[r0:r0 + len(where)]
            else:
                target = lg.argmax(dim=-1).tolist()
            toks = accept_greedy(draft, target)
        else:
            probs = target_probs(lg, p).cpu()
            toks = rejection_sample(probs, draft, None, seq.generator or self.generator)
        accepted = len(toks) - 1
        self.stats.record(len(draft), accepted)
        self.policy.record(seq.spec, len(draft), accepted)
        if p.logprobs is None:
            return toks, [None] * len(toks)
        return toks, row_logprobs(lg[:len(toks)], toks, p.logprobs)
