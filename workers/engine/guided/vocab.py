"""What a guided request needs of the tokenizer, and the constraint for a request.

`GuidedVocab` caches each token's text and builds the first-character table the
constrained sampler's prefilter uses (once, at the first guided request);
`constraint_for` picks the guided mode a request's parameters ask for.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..api import SamplingParams
from .choice import ChoiceState
from .constraint import TokenConstraint
from .json_object import JsonState
from .regex import RegexState, compile_regex
from .schema import SchemaState, compile_schema


def wants_guidance(params: SamplingParams) -> bool:
    return bool(params.json_object or params.json_schema is not None or params.guided_choice
                or params.guided_regex)


class GuidedVocab:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size     # the model's: may exceed the tokenizer's
        self._texts: dict[int, str] = {}
        self._first_code_table: np.ndarray | None = None

    def token_text(self, token_id: int) -> str:
        """What a token adds to the text, cached (guided modes check the same few often)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.token_text(token_id)
        return text

    def first_codes(self) -> np.ndarray:
        """Each token's first character (code point; -1 for no text), for the constrained
        sampler's vectorised prefilter (TokenConstraint.prefilter); built at first use."""
        if self._first_code_table is None:
            n = max(self.vocab_size, self.tokenizer.vocab_size)
            table = np.full(n, -1, dtype=np.int32)
            for t in range(min(n, self.tokenizer.vocab_size)):
                text = self.token_text(t)
                if text:
                    table[t] = ord(text[0])
            self._first_code_table = table
        return self._first_code_table

    def constraint_for(self, params: SamplingParams) -> TokenConstraint:
        """The request's guided mode (guided_choice, guided_regex, json_schema, json_object)."""
        state = ChoiceState.start(params.guided_choice) if params.guided_choice else \
            RegexState.start(compile_regex(params.guided_regex)) if params.guided_regex else \
            SchemaState.start(compile_schema(params.json_schema)) \
            if params.json_schema is not None else JsonState()
        return TokenConstraint(self.token_text, state, first_codes=self.first_codes())
