"""kvyard's torch-free tokenizer against transformers, the oracle, on the demo GGUF.

The EPP hashes the ids this module produces and the workers cache KV under
the same hashes, so any disagreement with transformers is a silent routing
bug; these tests compare ids and text exactly.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvyard.common.models import ModelSource
from kvyard.common.tokenizer import load_tokenizer

TEXTS = [
    "Hello world! 12345 and 3.14159, ok?",
    "  leading   spaces\n\n\ttabs  and trailing   ",
    "\n\n\n    \r\n  \t\t",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵",
    "Ünïcödé àccents — “quotes” ‘single’ …",
    "def f(x: int) -> int:\n    return x ** 2  # squares\n\nprint(f(3))\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><filename>a.py<file_sep><gh_stars>10",
    "almost special <|im_start <im_start|> <|im_end|x",
    "Ġ ġ Ā ċ literal byte-alphabet characters",
    "don't can't I'm you're we've they'll he'd",
    "a , b . c ' s ( ) [ ] { } ; : ? !",
    "x" * 300 + " " + "ab" * 200,
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the GPU cross the road?"},
        {"role": "user", "content": "Why? 🤔 日本語で"},
    ],
    [{"role": "user", "content": "  spaces \n\n and <|im_end|> inside  "}],
    [{"role": "user", "content": ""}],
]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decode_match_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == hf.encode(text)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    # byte-level BPE is lossless when special tokens are kept
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>") == [tok.bos_token_id]
    assert tok.encode("<|im_end|>") == [tok.eos_token_id]
    assert tok.decode(tok.encode("a<|im_end|>b")) == "ab"


def test_metadata_matches_transformers(tok, hf):
    assert tok.vocab_size == len(hf)
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.eos_token_id == hf.eos_token_id
    assert hf.eos_token_id in tok.eos_token_ids
    assert tok.token_to_id("<|endoftext|>") in tok.eos_token_ids
    assert tok.name == "SmolLM2-135M-Instruct"


def test_encode_batch_equals_single(tok):
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_long_prompt_matches_transformers(tok, hf):
    text = "\n".join(TEXTS) * 150
    ids = tok.encode(text)
    assert len(ids) > 20_000
    assert ids == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, hf, conv, gen):
    text = tok.apply_chat_template(conv, add_generation_prompt=gen)
    assert text == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    want = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, return_dict=False)
    assert tok.encode_chat(conv, add_generation_prompt=gen) == list(want)


def test_text_parts_are_joined(tok, hf):
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"},
                                          {"type": "text", "text": "second"}]}]
    joined = [{"role": "user", "content": "first\nsecond"}]
    assert tok.apply_chat_template(parts) == hf.apply_chat_template(
        joined, tokenize=False, add_generation_prompt=True)


def test_callers_messages_are_not_mutated(tok):
    conv = [{"role": "user", "content": [{"type": "text", "text": "x"}], "name": None}]
    before = repr(conv)
    tok.apply_chat_template(conv)
    assert repr(conv) == before


def test_hf_directory_matches_gguf(tok, hf, tmp_path):
    hf.save_pretrained(tmp_path)
    from_dir = load_tokenizer(ModelSource("hf", tmp_path, "from-dir"))
    assert from_dir is not tok
    for text in TEXTS:
        assert from_dir.encode(text) == tok.encode(text)
        assert from_dir.encode(text, add_special_tokens=True) == hf.encode(text)
    for conv in CONVERSATIONS:
        assert from_dir.encode_chat(conv) == tok.encode_chat(conv)
    assert (from_dir.bos_token_id, from_dir.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)


def test_memoized_per_path(tok, demo_gguf):
    assert load_tokenizer("demo") is tok
    assert load_tokenizer(str(demo_gguf)) is tok
    assert load_tokenizer(ModelSource("gguf", demo_gguf, "other-name")) is tok


MULTIBYTE = [
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵 ok",
    "mixed ascii then ünïcödé — “quotes” then 漢字 and 🎉🎉🎉",
]


@pytest.mark.parametrize("text", MULTIBYTE)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_equals_full_decode(tok, text, chunk):
    ids = tok.encode(text)
    # the test only means something if some token boundary splits a character
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    det = tok.incremental_detokenizer(prompt_ids=tok.encode("<|im_start|>assistant\n"))
    deltas = [det.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(det.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == det.text == tok.decode(ids) == text


def test_incremental_detokenizer_skips_special_tokens(tok):
    ids = tok.encode("Hi 😀<|im_end|>")
    det = tok.incremental_detokenizer()
    out = "".join(det.add([i]) for i in ids) + det.flush()
    assert out == "Hi 😀"
    assert det.add([]) == ""


def test_flush_releases_an_incomplete_tail(tok):
    ids = tok.encode("é😀")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    det = tok.incremental_detokenizer()
    held = det.add(ids[:cut])
    assert "\ufffd" not in held
    assert held + det.flush() == tok.decode(ids[:cut])


def test_module_imports_neither_torch_nor_transformers():
    code = ("import sys; from kvyard.common.tokenizer import load_tokenizer; "
            "t = load_tokenizer('demo'); t.encode_chat([{'role': 'user', 'content': 'x'}]); "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
