"""`kvyard bench route`'s workloads: shared-prefix groups and open-loop arrivals.

A prompt is a list of segments, each a (seed, length) pair whose token ids are
drawn from a seeded RNG, so a 7k-token prompt costs nothing until it is sent and
two prompts share exactly the segments they name. Token ids come from words that
the demo model's tokenizer encodes as one token each (" the", " and", ...), and
such words concatenate without merging (the byte-level pre-tokenizer splits at
each leading space), so `text(ids)` encodes back to `ids`: the simulator and the
EPP, which tokenize text, see exactly the token counts the workload chose.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

VOCAB_WORDS = 4096  # one-token words used; enough that unrelated segments never share a block


@dataclass(slots=True)
class Vocab:
    """One-token words of a tokenizer: token id -> text, and the ids to draw from."""

    ids: list[int]
    words: dict[int, str]

    @classmethod
    def from_tokenizer(cls, tok, size: int = VOCAB_WORDS) -> "Vocab":
        """Lower-case alphabetic words with a leading space that round-trip as one token."""
        words: dict[int, str] = {}
        for piece, tid in sorted(tok.backend.get_vocab().items(), key=lambda kv: kv[1]):
            w = piece[1:]
            if piece.startswith("\u0120") and len(w) >= 3 and w.isascii() and w.isalpha() \
                    and w.islower() and tok.encode(" " + w) == [tid]:
                words[tid] = " " + w
                if len(words) == size:
                    break
        return cls(list(words), words)

    @classmethod
    def demo(cls) -> "Vocab":
        from kvyard.common.tokenizer import load_tokenizer

        return cls.from_tokenizer(load_tokenizer("demo"))

    def text(self, ids: Sequence[int]) -> str:
        w = self.words
        return "".join(w[i] for i in ids)


@dataclass(slots=True, frozen=True)
class Segment:
    seed: int
    length: int

    def ids(self, vocab_ids: Sequence[int]) -> list[int]:
        r = random.Random(self.seed)
        n = len(vocab_ids)
        return [vocab_ids[int(r.random() * n)] for _ in range(self.length)]


@dataclass(slots=True)
class RouteRequest:
    at_s: float                      # arrival, seconds after the run starts
    segments: tuple[Segment, ...]
    output_tokens: int
    group: int = -1                  # tenant (shared-prefix group); -1: unknown (a trace)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    def token_ids(self, vocab_ids: Sequence[int]) -> list[int]:
        out: list[int] = []
        for s in self.segments:
            out += s.ids(vocab_ids)
        return out


@dataclass(slots=True, frozen=True)
class SharedPrefix:
    """G groups (tenants) x a P-token prefix each x U users x Q-token questions.

    Each request picks a group and a user uniformly; its prompt is the group's
    prefix then that user's question (llm-d's and inference-perf's shared-prefix
    shape). With `turns` > 1 a user's successive requests are a conversation: each
    turn appends a fixed A-token answer and a new question to the previous prompt,
    up to `turns`, then the conversation starts over.
    """

    groups: int = 150
    prefix_tokens: int = 6000
    users: int = 5
    question_tokens: int = 1200
    output_tokens: int = 1000
    turns: int = 1
    answer_tokens: int = 100
    seed: int = 0

    def unique_tokens(self) -> int:
        """Distinct prompt tokens the workload can send (its cache demand)."""
        per_user = self.question_tokens * self.turns + self.answer_tokens * (self.turns - 1)
        return self.groups * (self.prefix_tokens + self.users * per_user)

    def _seg(self, *key: int) -> int:
        # A distinct, reproducible seed per (kind, group, user, turn).
        return hash((self.seed, *key)) & 0x7FFF_FFFF_FFFF_FFFF

    def prompts(self, n: int, rng: random.Random) -> Iterator[tuple[int, tuple[Segment, ...]]]:
        turn: dict[tuple[int, int], int] = {}
        for _ in range(n):
            g, u = rng.randrange(self.groups), rng.randrange(self.users)
            t = turn.get((g, u), 0)
            turn[(g, u)] = (t + 1) % max(1, self.turns)
            segs = [Segment(self._seg(0, g), self.prefix_tokens)]
            for k in range(t + 1):
                if k:
                    segs.append(Segment(self._seg(2, g, u, k), self.answer_tokens))
                segs.append(Segment(self._seg(1, g, u, k), self.question_tokens))
            yield g, tuple(segs)


def arrivals(n: int, rate: float, rng: random.Random, burstiness: float = 1.0) -> list[float]:
    """n arrival offsets at `rate` req/s: gaps drawn from a gamma distribution of mean
    1/rate and shape `burstiness` (1: Poisson; < 1: bursty, as vLLM's bench serve)."""
    if rate <= 0 or rate == float("inf"):
        return [0.0] * n
    t, out = 0.0, []
    theta = 1.0 / (rate * burstiness)
    for _ in range(n):
        t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out


@dataclass(slots=True)
class Ladder:
    """A rate ladder: each rate for `duration_s` (rate x duration requests), one rung
    after another, each a fresh open-loop run; caches carry over, as in llm-d's sweeps."""

    rates: list[float]
    duration_s: float
    burstiness: float = 1.0
    seed: int = 0

    def counts(self) -> list[int]:
        return [max(1, math.ceil(r * self.duration_s)) for r in self.rates]

    def build(self, shape: SharedPrefix) -> list[list[RouteRequest]]:
        rng = random.Random(self.seed)
        counts = self.counts()
        prompts = shape.prompts(sum(counts), rng)
        rungs = []
        for rate, n in zip(self.rates, counts):
            at = arrivals(n, rate, rng, self.burstiness)
            rungs.append([RouteRequest(a, segs, shape.output_tokens, g)
                          for a, (g, segs) in zip(at, prompts)])
        return rungs

def prompt_texts(rungs: Sequence[Sequence[RouteRequest]], vocab: Vocab) -> list[list[str]]:
    """Each request's prompt as text, built once per distinct segment (segments start
    with a space-led word, so their texts concatenate to the prompt's)."""
    seg_text: dict[Segment, str] = {}

    def text(s: Segment) -> str:
        t = seg_text.get(s)
        if t is None:
            t = seg_text[s] = vocab.text(s.ids(vocab.ids))
        return t

    return [["".join(text(s) for s in r.segments) for r in rung] for rung in rungs]
