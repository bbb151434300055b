"""The one tokenizer every kvyard component uses: Rust `tokenizers` plus jinja2.

The EPP must never import torch or transformers, yet its token ids (hence its
prefix hashes) must equal the workers'; so both sides load the model's
tokenizer through here, from the same files, with the same rules as
transformers (checked against it in tests/common/test_tokenizer.py).
All per-token work runs in Rust: a 50k-token prompt is one `encode` call.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvyard.common.chat import ChatTemplateError, render_chat
from kvyard.common.models import ModelSource, resolve_model
from kvyard.common.tokenizer_build import TokenizerLoadError, TokenizerParts, from_gguf, from_hf_dir

__all__ = ["ChatTemplateError", "ChatTokenizer", "IncrementalDetokenizer", "TokenizerLoadError",
           "load_tokenizer"]


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Text deltas for one request's output tokens as they arrive.

    A byte-level BPE token can end in the middle of a UTF-8 character; the Rust
    `DecodeStream` holds such bytes back until the character is complete, so a
    client never sees a replacement character that the full text lacks. The
    deltas concatenate to `decode(all output ids)`; call `flush()` at the end
    to release anything still held (only an invalid byte tail can be).
    """

    _backend: Tokenizer
    _stream: DecodeStream
    skip_special_tokens: bool = True
    text: str = ""
    token_ids: list[int] = field(default_factory=list)

    def add(self, token_ids: Sequence[int]) -> str:
        ids = list(token_ids)
        if not ids:
            return ""
        self.token_ids.extend(ids)
        delta = self._stream.step(self._backend, ids)
        if not delta:
            return ""
        self.text += delta
        return delta

    def flush(self) -> str:
        full = self._backend.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(self.text) or not full.startswith(self.text):
            return ""
        delta = full[len(self.text):]
        self.text = full
        return delta


@dataclass(slots=True)
class ChatTokenizer:
    """Encode/decode and chat rendering for one model; shared, thread-safe, read-only."""

    name: str
    backend: Tokenizer
    special_tokens: dict[str, str]          # bos_token/eos_token/... as templates see them
    chat_template: str | dict[str, str] | None
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int
    eos_token_ids: frozenset[int]
    _anchor: tuple[int, str] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_parts(cls, name: str, parts: TokenizerParts) -> "ChatTokenizer":
        tk = parts.backend
        special = {k: v for k, v in parts.special.items() if v is not None}
        eos = special.get("eos_token")
        eos_id = tk.token_to_id(eos) if eos is not None else None
        if eos_id is None:
            raise TokenizerLoadError(f"{name}: the tokenizer names no end-of-sequence token")
        bos = special.get("bos_token")
        return cls(
            name=name, backend=tk, special_tokens=special, chat_template=parts.chat_template,
            vocab_size=tk.get_vocab_size(with_added_tokens=True),
            bos_token_id=tk.token_to_id(bos) if bos is not None else None,
            eos_token_id=eos_id, eos_token_ids=frozenset({eos_id, *parts.extra_eos_ids}),
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Goes through the batch entry point on purpose: it skips offsets (2-3x
        faster on long prompts) and releases the GIL, so an async server can run
        it in a thread (`asyncio.to_thread`) without stalling its event loop."""
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Many texts at once; Rust spreads them over cores and skips offsets."""
        encs = self.backend.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_text(self, token_id: int) -> str:
        """The text `token_id` adds after other text (special tokens: ""). Decoding the id
        alone is not that for SentencePiece vocabularies, whose decoder drops a leading
        space at the start of a text ("▁the" alone is "the", after a word " the"); so it
        is decoded after an anchor token and the anchor's text is cut off."""
        if self._anchor is None:  # an ordinary token ("a") and its text, found once
            ids = self.encode("a")
            self._anchor = (ids[-1], self.decode(ids[-1:])) if ids else (-1, "")
        anchor, head = self._anchor
        if anchor < 0:
            return self.decode([token_id])
        full = self.decode([anchor, token_id])
        return full[len(head):] if full.startswith(head) else self.decode([token_id])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """transformers' `apply_chat_template(tokenize=False)`; kwargs (tools, documents,
        enable_thinking, ...) reach the template as variables. Bad messages raise
        ChatTemplateError."""
        return render_chat(self.chat_template, messages, special_tokens=self.special_tokens,
                           add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """transformers' `apply_chat_template(tokenize=True)`: the template writes any
        BOS itself, so no special tokens are added on top."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))

    def incremental_detokenizer(self, prompt_ids: Sequence[int] | None = None,
                                skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """`prompt_ids` give the decoder context (SentencePiece spaces depend on the
        previous token); they are not part of the produced text."""
        stream = DecodeStream(ids=list(prompt_ids) if prompt_ids else None,
                              skip_special_tokens=skip_special_tokens)
        return IncrementalDetokenizer(self.backend, stream, skip_special_tokens)


_cache: dict[tuple[str, str], ChatTokenizer] = {}
_lock = threading.Lock()


def _source(model_ref: str | Path | ModelSource) -> ModelSource:
    if isinstance(model_ref, ModelSource):
        return model_ref
    return resolve_model(str(model_ref))


def load_tokenizer(model_ref: str | Path | ModelSource) -> ChatTokenizer:
    """'demo', a .gguf file or a Hugging Face directory; one instance per file."""
    src = _source(model_ref)
    key = (src.kind, str(Path(src.path).resolve()))
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        if src.kind == "gguf":
            parts = from_gguf(Path(src.path))
        elif src.kind == "hf":
            parts = from_hf_dir(Path(src.path))
        else:
            raise TokenizerLoadError(f"unknown model source kind {src.kind!r}")
        tok = ChatTokenizer.from_parts(src.served_name, parts)
        _cache[key] = tok
        return tok
