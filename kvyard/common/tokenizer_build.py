"""Builds a `tokenizers.Tokenizer` (Rust) plus its chat facts from a GGUF file
or a Hugging Face directory, without transformers.

The target is bit-for-bit agreement with what `transformers` builds from the
same files, because the EPP's prefix hashes and the workers' KV blocks must
agree on every token id. Where transformers makes a choice (which tokens are
special, whether BOS is added, how a GGUF vocabulary is spelled) we make the
same one; the tests in tests/common/test_tokenizer.py hold us to it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kvyard.common.gguf_meta import read_metadata

# llama.cpp token_type values.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Texts llama.cpp treats as end-of-generation when a GGUF marks them CONTROL;
# a model may emit any of them to end its turn, so the engine must stop on them.
_EOG_TEXTS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>",
    "<|end|>", "</s>", "<|return|>", "<|end_of_text|>", "<EOT>", "<|EOT|>",
})

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (from llama.cpp's and
# tiktoken's published patterns). Anything not listed keeps GPT-2's regex,
# which is what transformers does too.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_O200K_WORD = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (_O200K_WORD + r"*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
          + _O200K_WORD + r"+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PATTERNS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O),
}


class TokenizerLoadError(RuntimeError):
    pass


@dataclass(slots=True)
class TokenizerParts:
    """Everything `ChatTokenizer` needs, whichever file format it came from."""

    backend: Tokenizer
    special: dict[str, str | None]          # bos_token/eos_token/unk_token/pad_token -> text
    chat_template: str | dict[str, str] | None
    extra_eos_ids: set[int] = field(default_factory=set)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes keep
    their own character, the other 68 are moved to U+0100 onwards in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + shift)
            shift += 1
    return table


def _special_map(tokens: list[str], meta: dict[str, Any]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        idx = meta.get(f"tokenizer.ggml.{key}")
        out[name] = tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None
    return out


def _merge_pairs(meta: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]  # type: ignore[misc]


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece GGUFs often carry no merges: every split of a token into two
    vocabulary pieces is a merge, ranked by the whole token's score (best first),
    ties by piece lengths, then piece ids, the order transformers rebuilds them in."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int, int, str, str]] = []
    for tok, score in dict(zip(tokens, scores)).items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((-score, -len(left), -len(right), li, ri, left, right))
    # transformers sorts by (score, len(l), len(r)) descending with a stable sort over
    # pieces grouped per token in vocabulary order and by ids within a token.
    order = {t: i for i, t in enumerate(vocab)}
    ranked.sort(key=lambda r: (r[0], r[1], r[2], order[r[5] + r[6]], r[3], r[4]))
    return [(r[5], r[6]) for r in ranked]


def _byte_level_backend(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        # llama.cpp stores some tokens (e.g. whitespace runs) as raw text rather than
        # in the byte alphabet; respell those so BPE can find them.
        key = tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab[key] = i
    bpe = models.BPE(vocab=vocab, merges=_merge_pairs(meta), dropout=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    tk = Tokenizer(bpe)
    split = SPLIT_PATTERNS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_backend(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = _merge_pairs(meta)
    elif "tokenizer.ggml.scores" in meta:
        merges = _merges_from_scores(tokens, meta["tokenizer.ggml.scores"])
    else:
        raise TokenizerLoadError("SentencePiece GGUF has neither merges nor scores")
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                              dropout=None))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    return tk


def _add_typed_tokens(tk: Tokenizer, tokens: list[str], types: list[int], byte_level: bool) -> None:
    """CONTROL tokens become special (matched whole, skipped on decode);
    USER_DEFINED ones are matched whole but decoded. A byte-level CONTROL token
    spelled outside the byte alphabet is a converter mislabel and is left out."""
    spelled = set(byte_alphabet().values()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if ty == _CONTROL and (spelled is None or set(t) <= spelled)]
    if control:
        tk.add_special_tokens(control)
    vocab = tk.get_vocab(with_added_tokens=True)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and t in vocab]
    if user:
        tk.add_tokens(user)


def _finish(tk: Tokenizer, special: dict[str, str | None], add_bos: bool | None,
            add_eos: bool | None) -> None:
    """Named special tokens are always matched whole; BOS/EOS insertion follows
    the config flags when given, else the tokenizer's own post-processor."""
    added = {t.content for t in tk.get_added_tokens_decoder().values()}
    missing = [AddedToken(t, special=True) for t in dict.fromkeys(special.values())
               if t is not None and t not in added]
    if missing:
        tk.add_special_tokens(missing)
    if add_bos is None and add_eos is None and tk.post_processor is not None:
        return
    bos, eos = special.get("bos_token"), special.get("eos_token")
    use_bos = bool(add_bos) and bos is not None
    use_eos = bool(add_eos) and eos is not None
    single = f"{bos + ':0 ' if use_bos else ''}$A:0{' ' + eos + ':0' if use_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if use_bos else ''} $B:1{' ' + eos + ':1' if use_eos else ''}"
    pairs = []
    if use_bos:
        pairs.append((bos, tk.token_to_id(bos)))
    if use_eos:
        pairs.append((eos, tk.token_to_id(eos)))
    tk.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                      special_tokens=pairs)


def _wanted_key(key: str) -> bool:
    return key.startswith("tokenizer.") or key == "general.architecture"


def from_gguf(path: Path) -> TokenizerParts:
    meta = read_metadata(path, _wanted_key)
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerLoadError(f"{path}: GGUF file has no tokenizer vocabulary")
    if kind == "gpt2":
        tk = _byte_level_backend(meta, tokens)
    elif kind == "llama":
        if meta.get("general.architecture") in ("gemma", "gemma2", "gemma3", "phi3"):
            raise TokenizerLoadError(
                f"{path}: {meta['general.architecture']} SentencePiece GGUF tokenizers are not "
                "supported; use the Hugging Face directory (tokenizer.json) instead")
        tk = _sentencepiece_backend(meta, tokens)
    else:
        raise TokenizerLoadError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' "
            "byte-level BPE, 'llama' SentencePiece BPE); use the Hugging Face directory instead")
    types = meta.get("tokenizer.ggml.token_type") or []
    _add_typed_tokens(tk, tokens, types, byte_level=kind == "gpt2")
    special = _special_map(tokens, meta)
    # llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", True if kind == "llama" else None)
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    _finish(tk, special, add_bos, add_eos)
    extra = {meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
             if isinstance(meta.get(k), int)}
    extra |= {i for i, (t, ty) in enumerate(zip(tokens, types))
              if ty == _CONTROL and t in _EOG_TEXTS}
    return TokenizerParts(tk, special, meta.get("tokenizer.chat_template"), extra)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # a serialized AddedToken
        return v.get("content")
    return v if isinstance(v, str) else None


def _hf_chat_template(d: Path, cfg: dict[str, Any]) -> str | dict[str, str] | None:
    """transformers v5 saves the template beside the config; older dirs keep it inside."""
    main = d / "chat_template.jinja"
    named: dict[str, str] = {}
    extra_dir = d / "additional_chat_templates"
    if extra_dir.is_dir():
        named = {f.stem: f.read_text(encoding="utf-8") for f in sorted(extra_dir.glob("*.jinja"))}
    if main.exists():
        tpl: Any = main.read_text(encoding="utf-8")
    elif (d / "chat_template.json").exists():
        tpl = _read_json(d / "chat_template.json").get("chat_template")
    else:
        tpl = cfg.get("chat_template")
    if isinstance(tpl, list):
        named = {**{t["name"]: t["template"] for t in tpl}, **named}
        tpl = None
    if named:
        if tpl is not None:
            named["default"] = tpl
        return named
    return tpl


def from_hf_dir(d: Path) -> TokenizerParts:
    tj = d / "tokenizer.json"
    if not tj.exists():
        raise TokenizerLoadError(
            f"{d}: no tokenizer.json (only fast tokenizers are supported; convert with "
            "transformers' save_pretrained once)")
    tk = Tokenizer.from_file(str(tj))
    cfg = _read_json(d / "tokenizer_config.json")
    special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    _finish(tk, special, cfg.get("add_bos_token"), cfg.get("add_eos_token"))
    gen_eos = _read_json(d / "generation_config.json").get("eos_token_id")
    extra = set(gen_eos) if isinstance(gen_eos, list) else ({gen_eos} if isinstance(gen_eos, int) else set())
    return TokenizerParts(tk, special, _hf_chat_template(d, cfg), extra)
