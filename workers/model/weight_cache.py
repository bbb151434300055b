"""A built CPU model's weights, cached on disk and memory-mapped back on the next start.

Building turns the checkpoint into the kernels' layout: GGUF blocks dequantized,
rows fused, matrices re-laid as gemm.c's tiles (`GemmOps.pack`). That is compute,
about a second for the demo model and several on a busy machine, paid again by
every worker start (a scale-from-zero is one). The result depends only on the
file, the dtype, the strategy and the kernel build, so it is saved once with
`torch.save` and later loaded with `mmap=True`: the tensors are the file's pages,
read on first touch, shared by every worker of the host through the page cache.

Key: the weights' fingerprint plus each file's size, mtime and inode (an edited
file is a new key), the dtype, the strategy's class, the kernel library's file name
(its hash covers the C sources, flags, compiler and CPU), torch's version and
`LAYOUT` (bumped when a packed format changes). Only `GemmOps` models are cached:
their parts are plain tensors in dataclasses; oneDNN's packed weights are opaque.
The RoPE table and the greedy screen are rebuilt (cheap). Written to a temp file
and renamed; a file that does not load is rebuilt over. `KVYARD_WEIGHT_CACHE=0`
turns it off. `KVYARD_WEIGHT_CACHE_MAX_GB` (8) bounds the directory: the least
recently loaded entries go first, and a model bigger than that is not cached.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
LAYOUT = 1


def enabled() -> bool:
    return os.environ.get("KVYARD_WEIGHT_CACHE", "1") != "0"


def _dir() -> Path:
    base = os.environ.get("KVYARD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                              "kvyard")
    return Path(base) / "weights"


def key(src, dtype: torch.dtype, ops, library: str) -> str:
    from kvyard.common.models import fingerprint

    files = [src.path] if src.kind == "gguf" else sorted(Path(src.path).iterdir())
    h = hashlib.sha256(f"{LAYOUT}|{fingerprint(src)}|{dtype}|{type(ops).__name__}|{library}|"
                       f"{torch.__version__}".encode())
    for f in files:
        st = Path(f).stat()
        h.update(f"|{Path(f).name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}".encode())
    return h.hexdigest()[:24]


def path_for(src, dtype: torch.dtype, ops) -> Path | None:
    """Where this model's cache lives, or None when it is not cached."""
    from .linear_ops import GemmOps

    if not enabled() or not isinstance(ops, GemmOps) or src.kind not in ("gguf", "hf"):
        return None
    lib = getattr(ops.gemm, "path", None)
    if lib is None:
        return None
    return _dir() / f"{key(src, dtype, ops, Path(lib).name)}.pt"


def load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        got = torch.load(path, mmap=True, weights_only=False)
    except Exception as e:  # noqa: BLE001 - a bad file is rebuilt, never fatal
        log.warning("weight cache %s unreadable (%s); rebuilding it", path, e)
        return None
    try:
        os.utime(path)  # recently used: the last to be evicted
    except OSError:
        pass
    return got


def _cap() -> float:
    return float(os.environ.get("KVYARD_WEIGHT_CACHE_MAX_GB", "8")) * 1e9


def _evict(keep: Path) -> None:
    """Oldest-used entries out until the directory fits the cap."""
    entries = sorted(keep.parent.glob("*.pt"), key=lambda f: f.stat().st_mtime)
    total = sum(f.stat().st_size for f in entries)
    for f in entries:
        if total <= _cap():
            return
        if f != keep:
            total -= f.stat().st_size
            f.unlink(missing_ok=True)


def parts(model) -> dict[str, Any]:
    """What a built model is made of, minus what is rebuilt on load."""
    return {"embed": model.embed.data, "layers": model.layers,
            "final_norm": model.final_norm.data,
            "lm_head": model.embed.data if model.lm_head is model.embed else model.lm_head,
            "tied": model.tied, "int4_max_tokens": model.int4_max_tokens}


def save(path: Path, model) -> None:
    p = parts(model)
    if sum(t.nbytes for t in _tensors(p)) > _cap():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".pt.tmp")
        os.close(fd)
        try:
            torch.save(p, tmp)
            os.replace(tmp, path)
            _evict(path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:  # a full or read-only disk: serve anyway, uncached
        log.warning("weight cache %s not written: %s", path, e)


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif hasattr(obj, "__slots__"):
        for name in obj.__slots__:
            yield from _tensors(getattr(obj, name, None))
