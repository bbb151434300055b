"""Fixtures for the neutral module's tests: transformers is the tokenizer oracle."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hf(demo_gguf: Path):
    """transformers' own tokenizer for the demo GGUF (slow to build: shared per session)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(demo_gguf.parent), gguf_file=demo_gguf.name)


@pytest.fixture(scope="session")
def tok():
    from kvyard.common.tokenizer import load_tokenizer

    return load_tokenizer("demo")
