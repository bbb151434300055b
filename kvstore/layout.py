"""What a block *is*: its layout, and the namespace that keeps unlike blocks apart.

A key is the 16-byte namespace digest followed by the 16-byte chained block
hash. The digest folds in the model identity (name + weights fingerprint) and
the full KV layout, so a block computed by another model, another dtype or
another block size can never be served, in any tier, even when the token
hashes collide by construction (same prompt, different model).

A quantized KV cache (`--kv-cache-dtype int8|fp8`) stores each (token, head)
row as `head_dim` one-byte codes followed by `scale_bytes` of its scale: the
block carries its scales inside, and `scale_bytes` joins the identity, so an
int8 block with scales never meets one without.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import xxhash

# dtype name -> (wire code, bytes per element). Codes are part of the on-disk
# format: never renumber, only append.
DTYPES: dict[str, tuple[int, int]] = {
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
    "int8": (4, 1),
    "uint8": (5, 1),
    "float8_e4m3fn": (6, 1),
    "float8_e5m2": (7, 1),
}
KEY_BYTES = 32


@dataclass(slots=True, frozen=True)
class KVLayout:
    """One block's K and V for every layer: shape [layers, 2, block_size, kv_heads, row], row =
    head_dim elements, plus `scale_bytes` of per-row scale for a quantized cache."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    scale_bytes: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; known: {sorted(DTYPES)}")
        if min(self.block_size, self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"KV layout dimensions must be positive: {self}")
        if self.scale_bytes < 0 or self.scale_bytes % self.itemsize:
            raise ValueError(f"scale_bytes must be a whole number of elements: {self}")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads,
                self.head_dim + self.scale_bytes // self.itemsize)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def dtype_code(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True, frozen=True)
class Namespace:
    """Model identity + layout, reduced to a digest that prefixes every key."""

    model: str
    layout: KVLayout
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lay = self.layout
        canon = (f"kvyard-kv/v1|{self.model}|{lay.dtype}|{lay.block_size}|{lay.num_layers}"
                 f"|{lay.num_kv_heads}|{lay.head_dim}" + (f"|s{lay.scale_bytes}" if lay.scale_bytes else ""))
        object.__setattr__(self, "digest", xxhash.xxh3_128_digest(canon.encode()))

    def key(self, block_hash: int) -> bytes:
        return self.digest + block_hash.to_bytes(16, "little")

    def keys(self, block_hashes) -> list[bytes]:
        d = self.digest
        return [d + h.to_bytes(16, "little") for h in block_hashes]
