"""How a worker turns a request's prompt into token ids, for whoever must agree with it.

The worker (vLLM's rules): chat messages are rendered with the chat template and
encoded without special tokens (the template writes any BOS itself); a completions
prompt given as text is encoded *with* special tokens (BOS for Llama-style
tokenizers); a prompt given as token ids is used as it is. The EPP's precise prefix
scorer hashes the same ids, so it needs the special ids that encoding adds before the
text (`special_prefix`): text is tokenized in chunks without them, and they are
prepended once.
"""
from __future__ import annotations

from typing import Any

_PROBE = "a"


def special_prefix(tok: Any) -> list[int]:
    """The ids `tok.encode(text, add_special_tokens=True)` puts before the text's own
    (e.g. [BOS]); [] when it adds none or cannot say."""
    try:
        with_special = list(tok.encode(_PROBE, add_special_tokens=True))
        plain = list(tok.encode(_PROBE, add_special_tokens=False))
    except TypeError:  # an encoder without the flag adds nothing
        return []
    if not plain:
        return []
    for i in range(len(with_special) - len(plain) + 1):
        if with_special[i:i + len(plain)] == plain:
            return with_special[:i]
    return []
