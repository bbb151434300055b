"""From a parsed request to chained block hashes, tokenizing only what a
decision needs.

Why tokens and not characters: the hashes are `kvyard.common.hashing`
block hashes over token ids, the same keys the engines and the kvstore use, so
a future precise scorer fed by KV events can share this request side.

Which tokenizer: the EPP loads the served model's own tokenizer from
`--model` (`demo`, a .gguf file or a Hugging Face directory — in Kubernetes
the same model volume the workers mount), through `kvyard.common.tokenizer`,
which needs neither torch nor transformers. It never downloads anything.
Until it has loaded (in the background, so the EPP starts at once), or with
`--model none`, prompts are hashed as "byte-quad" pseudo tokens (every 4
UTF-8 bytes one id): deterministic, ~free, and good enough for affinity.

Cost: BPE encoding is by far the most expensive part of a decision (µs per
token), so it is avoided three ways:

1. Chunks. Text is cut into ~1 KB chunks at places where BPE
   pre-tokenization cannot merge across (before a space or newline that
   follows a letter; checked equal to whole-text encoding in the tests).
   Chunk boundaries depend only on the text before them, so prompts with a
   common prefix share every chunk before they diverge.
2. A chunk cache (LRU by chunk text): shared prefixes — system prompts,
   earlier turns, the very thing prefix routing is about — are encoded once.
3. Laziness. `LazyPrompt` tokenizes and hashes chunk by chunk only as far as
   the prefix scorer walks, i.e. to the first block no endpoint holds. The
   rest is needed only to teach the index, which `finish()` does after the
   routing answer has gone back to Envoy (in a worker thread; the Rust
   tokenizer releases the GIL). The prefix score's denominator (total
   blocks) is estimated from the text length until then.
"""
from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from kvyard.common.hashing import NONE_HASH, block_hashes, seed_for
from kvyard.common.prompt_tokens import special_prefix

from .request import ParsedRequest, Rejection

# Before " x" or "\n" when the previous character is a letter: every BPE
# pre-tokenizer we know (GPT-2, Llama 3, SmolLM) ends a piece there.
_SAFE_CUT = re.compile(r"(?<=[^\W\d_])(?= [^\W\d_]|\n)")
_LOOKAHEAD = 16  # cached chunks hashed together during a prefix walk (~4k tokens)


class Tokenizer(Protocol):
    """`kvyard.common.tokenizer.ChatTokenizer`; `encode_batch` is used when present."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str: ...


def next_cut(text: str, start: int, target: int) -> int:
    """End of the chunk that starts at `start`: the first safe place at or
    after `target` characters, or the end of the text."""
    if len(text) - start <= target:
        return len(text)
    m = _SAFE_CUT.search(text, start + target)
    return len(text) if m is None else m.start()


def split_chunks(text: str, target: int) -> list[str]:
    out: list[str] = []
    start = 0
    while start < len(text) or not out:
        end = next_cut(text, start, target)
        out.append(text[start:end])
        start = end
    return out


@dataclass(slots=True)
class _ChunkCache:
    """Chunk text -> token ids; shared by the loop and the finisher thread."""

    max_tokens: int
    _lru: OrderedDict = field(default_factory=OrderedDict)
    _tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    hits: int = 0
    misses: int = 0

    def get(self, key: str) -> array | None:
        with self._lock:
            v = self._lru.get(key)
            if v is not None:
                self._lru.move_to_end(key)
                self.hits += 1
            return v

    def put(self, key: str, ids: array) -> None:
        with self._lock:
            self.misses += 1
            old = self._lru.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._lru[key] = ids
            self._tokens += len(ids)
            while self._tokens > self.max_tokens and self._lru:
                _, old = self._lru.popitem(last=False)
                self._tokens -= len(old)


@dataclass(slots=True)
class LazyPrompt:
    """A prompt's block hashes, computed only as far as anyone looks.

    Chunks are cut from `text` on demand too: a cold 200 KB prompt costs one
    chunk's tokenization at decision time, not a pass over all of it.
    """

    block_size: int
    seed: int
    hashes: list[int] = field(default_factory=list)
    text: str = ""  # rendered prompt still to be tokenized from `_pos`
    hasher: "PromptHasher | None" = None
    chars_per_token: float = 4.0
    tokens: int = 0  # tokens seen so far
    # Ids the worker puts before these tokens (a completions prompt's BOS; see
    # kvyard.common.prompt_tokens): not in `hashes`, read by the precise scorer.
    lead: array = field(default_factory=lambda: array("I"))
    ids: array = field(default_factory=lambda: array("I"))  # every token id seen so far
    _pos: int = 0
    _tail: array = field(default_factory=lambda: array("I"))  # ids not yet in a full block

    @classmethod
    def of_ids(cls, ids: Sequence[int], block_size: int, seed: int) -> "LazyPrompt":
        p = cls(block_size, seed)
        p._add(array("I", ids))
        return p

    @classmethod
    def of_hashes(cls, hashes: list[int]) -> "LazyPrompt":
        """For callers (and tests) that already hold the hashes."""
        return cls(1, 0, list(hashes))

    @property
    def done(self) -> bool:
        return self._pos >= len(self.text)

    def _add(self, ids: array) -> None:
        self.tokens += len(ids)
        self.ids.extend(ids)
        self._tail.extend(ids)
        bs = self.block_size
        full = len(self._tail) // bs * bs
        if full:
            parent = self.hashes[-1] if self.hashes else NONE_HASH
            self.hashes.extend(block_hashes(self._tail[:full], bs, seed=self.seed, parent=parent))
            del self._tail[:full]

    def _chunk(self) -> str:
        end = next_cut(self.text, self._pos, self.hasher.chunk_chars)
        c = self.text[self._pos:end]
        self._pos = end
        return c

    def _extend(self, n: int | None) -> None:
        """Tokenizes `n` more chunks (None: all); when n == 1 a lookahead of
        already cached chunks rides along (one hashing call, not one per chunk)."""
        h = self.hasher
        taken: list[str] = []
        while not self.done and (n is None or len(taken) < n):
            taken.append(self._chunk())
        ids = array("I")
        for got in h.encode_chunks(taken):
            ids.extend(got)
        if n == 1:
            for _ in range(_LOOKAHEAD):
                if self.done:
                    break
                mark = self._pos
                got = h.cached(self._chunk())
                if got is None:
                    self._pos = mark
                    break
                ids.extend(got)
        self._add(ids)
        if self.tokens:  # this prompt's own ratio beats the pool-wide guess
            self.chars_per_token = self._pos / self.tokens

    def more(self) -> bool:
        """Tokenizes the next chunk (with cached lookahead); False when all is done."""
        if self.done:
            return False
        self._extend(1)
        return True

    def get(self, i: int) -> int | None:
        """Hash of block i, tokenizing further if needed; None past the end."""
        while i >= len(self.hashes) and not self.done:
            self._extend(1)
        return self.hashes[i] if i < len(self.hashes) else None

    def finish(self) -> list[int]:
        """All full-block hashes (tokenizes whatever is left in one batch)."""
        if not self.done:
            self._extend(None)
        return self.hashes

    def estimated_blocks(self) -> int:
        if self.done:
            return len(self.hashes)
        pending = len(self._tail) + (len(self.text) - self._pos) / self.chars_per_token
        return len(self.hashes) + int(pending // self.block_size)


def _flatten_messages(messages: list) -> str:
    """Fallback rendering when no tokenizer is loaded: role and text parts."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<{m.get('role', '')}>\n{content or ''}\n")
    return "".join(parts)


@dataclass(slots=True)
class PromptHasher:
    """Renders a request's prompt and hands out its lazily hashed blocks."""

    block_size: int = 64
    tokenizer: Tokenizer | None = None
    chunk_chars: int = 1024
    cache_tokens: int = 4_000_000
    template_error: type[BaseException] | None = None
    chars_per_token: float = 4.0  # running estimate, for the lazy denominator
    _cache: _ChunkCache = field(init=False)
    _seeds: dict[str, int] = field(default_factory=dict)
    _lead: array = field(default_factory=lambda: array("I"))  # special ids before text prompts

    def __post_init__(self) -> None:
        self._cache = _ChunkCache(self.cache_tokens)

    @property
    def mode(self) -> str:
        return "tokens" if self.tokenizer is not None else "bytes"

    def set_tokenizer(self, tok: Tokenizer, template_error: type[BaseException] | None) -> None:
        self.tokenizer, self.template_error = tok, template_error
        self._lead = array("I", special_prefix(tok))
        self._cache = _ChunkCache(self.cache_tokens)
        self._seeds.clear()

    def render(self, req: ParsedRequest) -> str | array:
        """The prompt as text (to tokenize) or as ids (completions with ids)."""
        if req.messages is not None:
            if self.tokenizer is None:
                return _flatten_messages(req.messages)
            try:
                return self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - only the tokenizer's own error is a 400
                if self.template_error is not None and isinstance(e, self.template_error):
                    raise Rejection(400, f"invalid messages: {e}", "bad_messages") from None
                raise
        p: Any = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]  # batched prompt: route by the first
        if isinstance(p, list):
            if not all(isinstance(t, int) and 0 <= t < 2**32 for t in p):
                raise Rejection(400, "'prompt' token ids must be non-negative integers",
                                   "bad_prompt")
            return array("I", p)
        if not isinstance(p, str):
            raise Rejection(400, "'prompt' must be a string or token ids", "bad_prompt")
        return p

    def cached(self, chunk: str) -> array | None:
        return self._cache.get(chunk)

    def encode_chunks(self, chunks: list[str]) -> list[array]:
        """Ids per chunk: from the cache, the misses in one Rust call (which
        spreads them over cores and releases the GIL)."""
        cache, tok = self._cache, self.tokenizer
        found = [cache.get(c) for c in chunks]
        missing = [c for c, f in zip(chunks, found) if f is None]
        if missing:
            batch = getattr(tok, "encode_batch", None)
            encoded = batch(missing) if batch and len(missing) > 1 else [
                tok.encode(c) for c in missing]
            fresh = iter(encoded)
            n_chars = n_tok = 0
            for i, f in enumerate(found):
                if f is None:
                    found[i] = got = array("I", next(fresh))
                    cache.put(chunks[i], got)
                    n_chars, n_tok = n_chars + len(chunks[i]), n_tok + len(got)
            if n_tok:
                self.chars_per_token = 0.9 * self.chars_per_token + 0.1 * (n_chars / n_tok)
        return found

    def _seed(self, model: str) -> int:
        seed = self._seeds.get(model)
        if seed is None:
            key = model if self.tokenizer is not None else model + "/bytes"
            seed = self._seeds[model] = seed_for(key)
        return seed

    def prompt(self, req: ParsedRequest) -> LazyPrompt:
        rendered = self.render(req)
        seed = self._seed(req.model)
        if isinstance(rendered, array):
            return LazyPrompt.of_ids(rendered, self.block_size, seed)
        if self.tokenizer is None:
            data = rendered.encode("utf-8")
            ids = array("I")
            ids.frombytes(data[: len(data) // 4 * 4])
            return LazyPrompt.of_ids(ids, self.block_size, seed)
        # chat text carries its own BOS (the template's); completions text gets the
        # tokenizer's special prefix, as the worker encodes it
        lead = self._lead if req.messages is None else array("I")
        return LazyPrompt(self.block_size, seed, text=rendered, hasher=self,
                          chars_per_token=self.chars_per_token, lead=lead)

    def hashes(self, req: ParsedRequest) -> tuple[list[int], int]:
        """(all block hashes, token count), eagerly."""
        p = self.prompt(req)
        return p.finish(), p.tokens
