"""GGUF tokenizer metadata: our header reader and builders against gguf's own
reader and transformers, on small GGUF files written here with gguf's writer."""
from __future__ import annotations

import time
from pathlib import Path

import gguf
import pytest

from kvyard.common.gguf_meta import GGUFFormatError, read_metadata
from kvyard.common.models import ModelSource
from kvyard.common.tokenizer import TokenizerLoadError, load_tokenizer
from kvyard.common.tokenizer_build import byte_alphabet, from_gguf

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def _write(path: Path, model: str, tokens: list[str], types: list[int], *,
           scores: list[float] | None = None, merges: list[str] | None = None,
           pre: str | None = None, extra=None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if extra:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> Path:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "lo", "llo", "▁he",
              "hello", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "▁l", "ol", "▁lol", "日", "▁日"]
    for i, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(-float(i % 7))
    tokens.append("<|user|>")
    types.append(USER_DEFINED)
    scores.append(0.0)
    return _write(tmp_path_factory.mktemp("spm") / "spm.gguf", "llama", tokens, types,
                  scores=scores, extra=lambda w: w.add_unk_token_id(0))


@pytest.fixture(scope="module")
def bpe_gguf(tmp_path_factory) -> Path:
    alpha = list(byte_alphabet().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|bad control|>"] + alpha
    types = [CONTROL, CONTROL, CONTROL, CONTROL] + [NORMAL] * 256
    merges = ["Ġ h", "e l", "el l", "Ġh ell", "Ġhell o", "1 2", "12 3", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
        types.append(NORMAL)
    tokens[-3] = "  "  # llama.cpp keeps some whitespace tokens as raw text
    tokens += ["<think>"]
    types += [USER_DEFINED]
    return _write(tmp_path_factory.mktemp("bpe") / "bpe.gguf", "gpt2", tokens, types,
                  merges=merges, pre="llama-bpe")


TEXTS = ["hello world", " hello  world", "hellolol 日本", "x<|user|>hello", "<s>hi</s>",
         "<|im_start|>hello<|im_end|>", "  hello    12345\n\n\n", "<|bad control|><think>é", ""]


@pytest.mark.parametrize("which", ["spm_gguf", "bpe_gguf"])
def test_built_tokenizer_matches_transformers(request, which):
    transformers = pytest.importorskip("transformers")
    path: Path = request.getfixturevalue(which)
    ours = load_tokenizer(ModelSource("gguf", path, which))
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)


@pytest.mark.parametrize("which,piece", [("spm_gguf", "▁hello"), ("bpe_gguf", "Ġhello")])
def test_token_text_keeps_the_leading_space(request, which, piece):
    """What a token adds after other text: SentencePiece's decoder drops the leading space
    of a lone "▁hello", byte-level BPE keeps it; token_text must say " hello" for both."""
    t = load_tokenizer(ModelSource("gguf", request.getfixturevalue(which), which))
    tid = t.token_to_id(piece)
    assert tid is not None and t.token_text(tid) == " hello"
    if which == "spm_gguf":
        assert t.decode([tid]) == "hello"
    assert t.token_text(t.eos_token_id) == ""


def test_sentencepiece_adds_bos_by_default(spm_gguf):
    t = load_tokenizer(ModelSource("gguf", spm_gguf, "spm"))
    assert t.encode("hello", add_special_tokens=True)[0] == t.bos_token_id == 1


def _every_type(w: gguf.GGUFWriter) -> None:
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.floats", [0.25, -1.5])
    w.add_array("t.strs", ["a", "ß", ""])


def test_metadata_reader_agrees_with_gguf_reader(tmp_path):
    path = _write(tmp_path / "typed.gguf", "gpt2", ["a", "b", "c"], [NORMAL] * 3,
                  scores=[0.0, -1.0, -2.5], merges=["a b"], extra=_every_type)
    ours = read_metadata(path, lambda k: True)
    ref = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()
           if not k.startswith("GGUF.")}  # the reader's own header pseudo-fields
    assert len(ref) > 20
    assert ours == ref


def test_metadata_reader_skips_unwanted_keys(bpe_gguf):
    got = read_metadata(bpe_gguf, lambda k: k == "tokenizer.ggml.eos_token_id")
    assert got == {"tokenizer.ggml.eos_token_id": 2}


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        read_metadata(p, lambda k: True)


def test_truncated_gguf(bpe_gguf, tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(bpe_gguf.read_bytes()[:300])
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_metadata(p, lambda k: True)


def test_unsupported_tokenizer_model_is_a_clear_error(tmp_path):
    p = _write(tmp_path / "bert.gguf", "bert", ["[PAD]", "[CLS]", "[SEP]"], [CONTROL] * 3)
    with pytest.raises(TokenizerLoadError, match="'bert' is not supported"):
        load_tokenizer(ModelSource("gguf", p, "bert"))


def test_demo_loads_fast(demo_gguf):
    # CPU time, not wall time, so a busy shared machine does not flake this;
    # gguf.GGUFReader alone needs several seconds for the same file.
    start = time.process_time()
    parts = from_gguf(demo_gguf)
    assert time.process_time() - start < 1.5
    assert parts.backend.get_vocab_size() == 49152
