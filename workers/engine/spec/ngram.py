"""vLLM's `ngram` proposer (prompt lookup): the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, for the longest n in [min, max] that occurs.

Free to run (no model), so it pays wherever the output quotes its context: code edits,
summaries that repeat the document, structured text. It proposes nothing without a
match, so a sequence with no repetition decodes exactly as without speculation.
"""
from __future__ import annotations

import numpy as np

from .config import SpeculativeConfig


class NgramProposer:
    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.n_max = cfg.prompt_lookup_max
        self.n_min = cfg.prompt_lookup_min

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (none without a match)."""
        total = len(token_ids)
        if k <= 0 or total <= self.n_min:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        # candidates: earlier positions holding the last token (the end of a match)
        ends = np.flatnonzero(arr[:-1] == arr[-1])
        if not ends.size:
            return []
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            tail = arr[total - n:]
            ok = ends[ends >= n - 1]
            for j in range(1, n):     # narrow the candidates one token back at a time
                if not ok.size:
                    break
                ok = ok[arr[ok - j] == tail[n - 1 - j]]
            if ok.size:
                start = int(ok[-1]) + 1   # the latest occurrence: repetitive text repeats its recent past
                return arr[start:start + k].tolist()
        return []
