"""A pool whose workers tokenize otherwise than the EPP's `--model` (`tokenizer:` in the
models file): the EPP renders and tokenizes that pool's prompts (its adapters' too) with
that tokenizer, so precise prefix keys match the blocks its workers report; the other pools
keep the EPP's own. Real tokenizers: the demo GGUF's and a word-level HF directory."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kvyard.common.tokenizer import load_tokenizer
from kvyard.epp.app import EppApp, EppConfig
from kvyard.epp.models import ModelRoutes
from kvyard.epp.scheduling.types import SchedRequest

WORDS = ["[UNK]", "hello", "world", "again", "</s>"]
H = {":method": "POST", ":path": "/v1/completions"}


def _word_level_dir(d):
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["</s>"])
    d.mkdir()
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"unk_token": "[UNK]", "eos_token": "</s>"}))
    (d / "config.json").write_text("{}")
    return d


def _ids(app: EppApp, model: str, prompt: str) -> list[int]:
    req = app.director.parse(H, json.dumps({"model": model, "prompt": prompt}).encode())
    assert isinstance(req, SchedRequest)
    req.prompt.finish()
    return list(req.prompt.ids)


async def test_each_pool_is_keyed_with_its_own_tokenizer(tmp_path) -> None:
    words = _word_level_dir(tmp_path / "beta-tok")
    f = tmp_path / "models.json"
    f.write_text(json.dumps({"models": [
        {"name": "alpha", "tokenizer": "demo"},  # the EPP's own: no second copy
        {"name": "beta", "adapters": ["tone"], "tokenizer": str(words)}]}))
    app = EppApp(EppConfig(model="demo", seed=1, flow_control=False, models_file=str(f)))
    assert list(app.tokenizers) == ["demo", str(words)]
    await app._load_tokenizer()  # what start() runs, without the servers
    assert app.tokenizer_state == "loaded"
    demo = load_tokenizer("demo")
    text = "hello world again hello"
    assert _ids(app, "beta", text) == [1, 2, 3, 1]
    assert _ids(app, "tone", text) == [1, 2, 3, 1]  # an adapter: its base's tokenizer
    alpha = _ids(app, "alpha", text)
    assert alpha[-len(demo.encode(text)):] == demo.encode(text) and alpha != [1, 2, 3, 1]


def test_one_pool_one_tokenizer() -> None:
    routes = ModelRoutes.parse([{"name": "a", "tokenizer": "demo"},
                                {"name": "b", "pool": "p", "tokenizer": "/t/b"},
                                {"name": "c", "pool": "p", "tokenizer": "/t/b"}])
    assert routes.pool_tokenizers("demo") == {"p": "/t/b"}
    with pytest.raises(ValueError, match="two tokenizers"):
        ModelRoutes.parse([{"name": "b", "pool": "p", "tokenizer": "/t/b"},
                           {"name": "c", "pool": "p", "tokenizer": "/t/c"}]
                          ).pool_tokenizers("demo")
    with pytest.raises(ValueError, match="tokenizer"):
        ModelRoutes.parse([{"name": "a", "tokenizer": ""}])
