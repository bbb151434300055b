"""LoRA flags, vLLM's names: --enable-lora, --lora-modules, --max-loras, --max-lora-rank,
--max-cpu-loras. No torch here: the worker's CLI parses them before the engine loads."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field



@dataclass(slots=True, frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: `name=path` or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(slots=True)
class LoRAConfig:
    max_loras: int = 1                 # adapters in device slots at once (one batch's distinct adapters)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None   # loaded adapters kept in host memory; None: max_loras
    modules: list[LoRAModule] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, not {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, not {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names repeat: {names}")


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path`, or `{"name": ..., "path": ..., "base_model_name": ...}` (vLLM's JSON form)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: bad JSON {text!r}: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                or not isinstance(obj.get("path"), str) or set(obj) - {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(
                f"--lora-modules: JSON must have string 'name' and 'path' (and optional "
                f"'base_model_name'), not {text!r}")
        base = obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError("--lora-modules: 'base_model_name' must be a string")
        return LoRAModule(obj["name"], obj["path"], base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=path or JSON, not {text!r}")
    return LoRAModule(name, path)


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format)")
    p.add_argument("--lora-modules", type=parse_lora_module, nargs="+", action="extend", default=None,
                   metavar="NAME=PATH|JSON",
                   help="adapters served from the start: name=path or "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    p.add_argument("--max-loras", type=int, default=1,
                   help="adapters in one batch (device slots)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="loaded adapters kept in host memory (default: --max-loras)")


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """The LoRAConfig the flags ask for; None without --enable-lora (adapters then an error)."""
    if not getattr(args, "enable_lora", False):
        if getattr(args, "lora_modules", None):
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    return LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=args.max_cpu_loras, modules=list(args.lora_modules or []))
