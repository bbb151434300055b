"""From a parsed request to chained block hashes, tokenizing once per request.

Why tokens and not characters: the hashes are `kvyard.common.hashing`
block hashes over token ids, the same keys the engines and the kvstore use, so
a future precise scorer fed by KV events can share this request side.

Which tokenizer: the EPP loads the served model's own tokenizer from
`--model` (`demo`, a .gguf file or a Hugging Face directory — in Kubernetes
the same model volume the workers mount), through `kvyard.common.tokenizer`,
which needs neither torch nor transformers. It never downloads anything.
Until it has loaded (in the background, so the EPP starts at once), or when
`--model none`, prompts are hashed as "byte-quad" pseudo tokens (every 4
UTF-8 bytes one id): deterministic, ~free, and good enough for affinity.

Cost: BPE encoding is the expensive part of a decision (~1 µs per token).
Text is cut into ~2 KB chunks at places where BPE pre-tokenization cannot
merge across (before a space or newline that follows a letter), each chunk is
encoded separately and cached in an LRU keyed by the chunk text. Shared
prefixes — system prompts, earlier turns, the very thing prefix routing is
about — are therefore encoded once; only new text costs tokenizer time.
Chunk boundaries depend only on the text before them, so two prompts with a
common prefix get identical ids for every chunk before they diverge.
"""
from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvyard.common.hashing import block_hashes, seed_for

from .request import ParsedRequest, RequestError

# Before " x" or "\n" when the previous character is a letter: every BPE
# pre-tokenizer we know (GPT-2, Llama 3, SmolLM) ends a piece there.
_SAFE_CUT = re.compile(r"(?<=[^\W\d_])(?= [^\W\d_]|\n)")


class Tokenizer(Protocol):
    """`kvyard.common.tokenizer.ChatTokenizer`; `encode_batch` is used when present."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str: ...


def split_chunks(text: str, target: int) -> list[str]:
    """Cuts at the first safe place at or after every `target` characters."""
    out: list[str] = []
    start, n = 0, len(text)
    while n - start > target:
        m = _SAFE_CUT.search(text, start + target)
        if m is None:
            break
        out.append(text[start:m.start()])
        start = m.start()
    out.append(text[start:])
    return out


@dataclass(slots=True)
class _ChunkCache:
    max_tokens: int
    _lru: OrderedDict = field(default_factory=OrderedDict)
    _tokens: int = 0
    hits: int = 0
    misses: int = 0

    def get(self, key: str) -> array | None:
        v = self._lru.get(key)
        if v is not None:
            self._lru.move_to_end(key)
            self.hits += 1
        return v

    def put(self, key: str, ids: array) -> None:
        self.misses += 1
        old = self._lru.pop(key, None)
        if old is not None:
            self._tokens -= len(old)
        self._lru[key] = ids
        self._tokens += len(ids)
        while self._tokens > self.max_tokens and self._lru:
            _, old = self._lru.popitem(last=False)
            self._tokens -= len(old)


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
    """Renders, tokenizes (chunk-cached) and hashes a request's prompt."""

    block_size: int = 64
    tokenizer: Tokenizer | None = None
    chunk_chars: int = 2048
    cache_tokens: int = 4_000_000
    template_error: type[BaseException] | None = None
    _cache: _ChunkCache = field(init=False)
    _seeds: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._cache = _ChunkCache(self.cache_tokens)

    @property
    def mode(self) -> str:
        return "tokens" if self.tokenizer is not None else "bytes"

    def set_tokenizer(self, tok: Tokenizer, template_error: type[BaseException] | None) -> None:
        self.tokenizer, self.template_error = tok, template_error
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
                    raise RequestError(400, f"invalid messages: {e}", "bad_messages") from None
                raise
        p: Any = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]  # batched prompt: route by the first
        if isinstance(p, list):
            if not all(isinstance(t, int) and t >= 0 for t in p):
                raise RequestError(400, "'prompt' token ids must be non-negative integers",
                                   "bad_prompt")
            return array("I", p)
        if not isinstance(p, str):
            raise RequestError(400, "'prompt' must be a string or token ids", "bad_prompt")
        return p

    def token_ids(self, rendered: str | array) -> array:
        if isinstance(rendered, array):
            return rendered
        if self.tokenizer is None:
            data = rendered.encode("utf-8")
            ids = array("I")
            ids.frombytes(data[: len(data) // 4 * 4])
            return ids
        chunks = split_chunks(rendered, self.chunk_chars)
        found = [self._cache.get(c) for c in chunks]
        missing = [c for c, f in zip(chunks, found) if f is None]
        if missing:  # one Rust call for all new text: it spreads chunks over cores
            batch = getattr(self.tokenizer, "encode_batch", None)
            encoded = batch(missing) if batch and len(missing) > 1 else [
                self.tokenizer.encode(c) for c in missing]
            fresh = iter(encoded)
            for i, f in enumerate(found):
                if f is None:
                    found[i] = got = array("I", next(fresh))
                    self._cache.put(chunks[i], got)
        ids = array("I")
        for f in found:
            ids.extend(f)
        return ids

    def hashes(self, req: ParsedRequest) -> tuple[list[int], int]:
        """(block hashes, token count) for the request's prompt."""
        ids = self.token_ids(self.render(req))
        seed = self._seeds.get(req.model)
        if seed is None:
            key = req.model if self.tokenizer is not None else req.model + "/bytes"
            seed = self._seeds[req.model] = seed_for(key)
        return block_hashes(ids, self.block_size, seed=seed), len(ids)
