"""When a request ends, and which text it may stream before it does.

Stop strings are matched on detokenized text, since a stop string can span
token boundaries or start mid-token. Text that might still turn out to be
the start of a stop string is held back, so a client never receives a
fragment that is later trimmed away.
"""
from __future__ import annotations

from typing import Iterable, Sequence as Seq

from .sequence import Sequence


def find_stop(text: str, stops: Seq[str], new_from: int) -> int | None:
    """Start of the earliest stop string that ends in `text[new_from:]`, or None."""
    best: int | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def held_back(text: str, stops: Seq[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


def append_token(seq: Sequence, token: int, eos_token_ids: Iterable[int],
                 max_model_len: int) -> tuple[str, str | None]:
    """Add a sampled token; returns (text to stream now, finish reason or None).

    Stop and EOS tokens end the request and add no text (they are never fed
    to the detokenizer). Without a detokenizer only token ids are produced.
    """
    seq.token_ids.append(token)
    p = seq.params
    reason: str | None = None
    cut_at: int | None = None
    json_done = False
    c = seq.constraint
    if c is not None:  # JSON mode: the object closing ends the request
        try:
            c.advance(token)
            json_done = c.complete
        except ValueError:
            pass  # a token the JSON refuses (EOS, a stop token id): the state stays
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        reason = "stop"
    elif seq.detokenizer is not None:
        text_delta = seq.detokenizer.add([token])
        start = len(seq.output_text)
        seq.output_text += text_delta
        if p.stop:
            cut_at = find_stop(seq.output_text, p.stop, start)
            if cut_at is not None:
                seq.output_text = seq.output_text[:cut_at]
                reason = "stop"
    if reason is None and json_done:
        reason = "stop"
    if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len):
        reason = "length"
    if reason is not None and cut_at is None and seq.detokenizer is not None:
        seq.output_text += seq.detokenizer.flush()   # bytes held for a character that never completed
    end = len(seq.output_text)
    if reason is None and p.stop:
        end -= held_back(seq.output_text, p.stop)
    delta = seq.output_text[seq.num_emitted_chars:end] if end > seq.num_emitted_chars else ""
    seq.num_emitted_chars = max(seq.num_emitted_chars, end)
    return delta, reason
