"""A request's engine-block keys and the EPP's speculative entries: the keys are the
index's whatever order the walk asks for them in, and entries expire by pick."""
from __future__ import annotations

from kvyard.common.hashing import block_hashes
from kvyard.epp.kvevents.index import KEY_SEED
from kvyard.epp.kvevents.request_keys import EngineKeys
from kvyard.epp.kvevents.speculative import Speculative
from kvyard.epp.prompt import PromptHasher
from kvyard.epp.request import parse_request


def _prompt(text: str):
    from kvyard.common.tokenizer import load_tokenizer

    h = PromptHasher(chunk_chars=64)  # many chunks: the walk extends the prompt often
    h.set_tokenizer(load_tokenizer("demo"), None)
    body = ('{"model": "m", "prompt": %s}' % __import__("json").dumps(text)).encode()
    return h, h.prompt(parse_request(body, "/v1/completions", {}, None))


def test_keys_equal_the_whole_prompts_block_hashes_in_any_walk_order() -> None:
    text = " ".join(f"word{i} and some more text, line {i}.\n" for i in range(300))
    h, walked = _prompt(text)
    view = EngineKeys(walked, 16)
    got, i = [], 0
    while (k := view.get(i)) is not None:  # the scorer's walk: one block at a time
        got.append(k)
        i += 1
    _, whole = _prompt(text)
    whole.finish()
    ids = list(whole.lead) + list(whole.ids)
    want = block_hashes(ids, 16, seed=KEY_SEED)
    assert got == want and len(want) == len(ids) // 16 > 100
    late = EngineKeys(whole, 16)
    assert late.get(len(want) - 1) == want[-1] and late.known() == want  # jump to the end


def test_speculative_entries_expire_by_pick_and_keep_refreshed_ones() -> None:
    s = Speculative(ttl=2.0)
    s.add([1, 2], "a", 5.0)
    s.add([2, 3], "b", 3.0)  # a peer's older pick: expires first though added later
    s.add([1], "a", 8.0)     # picked again: block 1 now lives longer
    s.purge(4.0)
    assert s.holders(2, 4.0) == {"a": 5.0} and s.holders(3, 4.0) is None
    s.purge(6.0)
    assert s.holders(1, 6.0) == {"a": 8.0} and s.holders(2, 6.0) is None
    assert len(s) == 1
    s.add([4], "c", 9.0)
    assert s.holders(4, 9.5) is None  # expired, even before a purge
    s.confirm(1, "a")
    assert s.holders(1, 7.0) is None
    s.purge(100.0)
    assert len(s) == 0
