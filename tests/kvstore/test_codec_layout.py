"""The block format rejects anything that is not exactly the block asked for."""
from __future__ import annotations

import os

import pytest

from kvyard.kvstore import KVLayout, Namespace
from kvyard.kvstore.codec import HEADER_BYTES, CorruptBlock, decode, encode_header


def _blob(ns, layout, payload, h=7):
    key = ns.key(h)
    return key, encode_header(key, layout, payload) + payload


def test_roundtrip_is_a_view_of_the_payload(ns, layout, make_blocks):
    payload = make_blocks(1)[0]
    key, blob = _blob(ns, layout, payload)
    out = decode(blob, key, layout)
    assert isinstance(out, memoryview) and out.readonly
    assert bytes(out) == payload and len(blob) == HEADER_BYTES + layout.nbytes


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "flip_magic", "extra"])
def test_damage_is_detected(ns, layout, make_blocks, damage):
    key, blob = _blob(ns, layout, make_blocks(1)[0])
    b = bytearray(blob)
    if damage == "flip_payload":
        b[HEADER_BYTES + 5] ^= 0x40
    elif damage == "truncate":
        del b[-3:]
    elif damage == "flip_magic":
        b[0] ^= 1
    else:
        b += b"\0"
    with pytest.raises(CorruptBlock):
        decode(bytes(b), key, layout)


def test_wrong_key_or_layout_is_rejected(ns, layout, make_blocks):
    key, blob = _blob(ns, layout, make_blocks(1)[0])
    with pytest.raises(CorruptBlock):
        decode(blob, ns.key(8), layout)
    other = KVLayout("float16", layout.block_size, layout.num_layers, layout.num_kv_heads,
                     layout.head_dim)
    with pytest.raises(CorruptBlock):
        decode(blob, key, other)


def test_namespace_digest_separates_models_and_layouts(layout):
    a = Namespace("m@1", layout)
    assert a.key(5) == Namespace("m@1", layout).key(5)
    assert a.key(5) != Namespace("m@2", layout).key(5)
    for change in ({"dtype": "float32"}, {"block_size": 8}, {"num_layers": 4},
                   {"num_kv_heads": 1}, {"head_dim": 16}):
        fields = dict(dtype=layout.dtype, block_size=layout.block_size,
                      num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                      head_dim=layout.head_dim) | change
        assert Namespace("m@1", KVLayout(**fields)).key(5) != a.key(5), change
    assert layout.nbytes == 3 * 2 * 4 * 2 * 8 * 2


def test_checksum_is_xxh3_64_at_every_size():
    """Big payloads hash through the GIL-releasing streaming object, small ones one-shot:
    both must give the stored format's xxh3-64, or old blocks would read as corrupt."""
    import xxhash

    from kvyard.kvstore.codec import checksum

    for n in (0, 1, 240, 64 << 10, (64 << 10) - 1, 360 << 10, (2 << 20) + 3):
        b = os.urandom(n)
        assert checksum(b) == checksum(memoryview(b)) == xxhash.xxh3_64_intdigest(b), n
    flipped = bytearray(os.urandom(360 << 10))
    before = checksum(flipped)
    flipped[12345] ^= 0x10
    assert checksum(flipped) != before
