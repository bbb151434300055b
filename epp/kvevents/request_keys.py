"""A request's own block keys at an engine's block size, computed only as far as asked.

The keys are the index's (`index.py`): `block_hashes` over the token ids the worker
will run — the prompt's `lead` (a completions prompt's BOS) and then its ids — with
`KEY_SEED` (an adapter's request: `key_seed(adapter)`, as the index keys that adapter's
events), chained from the first block. The ids come from the request's
`LazyPrompt`, which tokenizes one chunk more whenever a key past what it has is
asked for, so a scoring walk costs tokenization only up to the longest match.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from kvyard.common.hashing import NONE_HASH, block_hashes

from ..prompt import LazyPrompt
from .index import KEY_SEED, key_seed


@dataclass(slots=True)
class EngineKeys:
    prompt: LazyPrompt
    block_size: int
    keys: list[int] = field(default_factory=list)
    seed: int = KEY_SEED  # key_seed(adapter) for a LoRA adapter's request, as its events are keyed

    @property
    def lead(self) -> int:
        return len(self.prompt.lead)

    def _ids(self, start: int, end: int) -> array:
        """Tokens [start, end) of lead + prompt ids (both already there)."""
        lead, ids = self.prompt.lead, self.prompt.ids
        n = len(lead)
        if start >= n:
            return ids[start - n:end - n]
        return lead[start:] + ids[:max(0, end - n)] if end > n else lead[start:end]

    def _available(self) -> int:
        return len(self.prompt.lead) + len(self.prompt.ids)

    def _hash_to(self, blocks: int) -> None:
        bs = self.block_size
        have = len(self.keys)
        if blocks <= have:
            return
        parent = self.keys[-1] if self.keys else NONE_HASH
        self.keys.extend(block_hashes(self._ids(have * bs, blocks * bs), bs, seed=self.seed,
                                      parent=parent))

    def get(self, i: int) -> int | None:
        """Key of block i; tokenizes further if needed; None past the prompt's end."""
        if i < len(self.keys):
            return self.keys[i]
        need = (i + 1) * self.block_size
        while self._available() < need and self.prompt.more():
            pass
        # every tokenized block at once: one hashing call per chunk the prompt tokenized
        # (with its cached lookahead, ~4k tokens), not one per few blocks the walk asks for
        self._hash_to(self._available() // self.block_size)
        return self.keys[i] if i < len(self.keys) else None

    def known(self) -> list[int]:
        """Keys of every full block tokenized so far (no further tokenization)."""
        self._hash_to(self._available() // self.block_size)
        return self.keys

    def estimated_blocks(self) -> int:
        """All of the prompt's blocks: exact once tokenized, estimated before."""
        p = self.prompt
        tokens = p.tokens if p.done else p.estimated_blocks() * p.block_size
        return (self.lead + tokens) // self.block_size

    def prompt_blocks(self, engine_blocks: int) -> int:
        """Engine blocks matched, as whole prompt-hash blocks (what PREFIX_MATCHES counts)."""
        tokens = max(0, engine_blocks * self.block_size - self.lead)
        return tokens // self.prompt.block_size
