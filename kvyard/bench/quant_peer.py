"""The peer of `kvyard bench quant`: llama.cpp on the same GGUF, when a build is given.

`--llama-cpp DIR` (or $KVYARD_LLAMA_CPP): a folder holding `llama-quantize`,
`llama-perplexity` and `llama-server` (e.g. llama.cpp's build/bin). Absent: the peer is
listed as unavailable. Its own quantizations of the demo GGUF (requantized from the
shipped Q4_1, as a user would with `--allow-requantize`), its perplexity on the same
text (`llama-perplexity`, its own windows: comparable between its rows, not to the last
digit with kvyard's), and `llama-server`'s c1 TPOT and c32 tokens/s with the client that
measures kvyard.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvyard.bench.servers import Server
from kvyard.stack import procs

PEER_TYPES = ("Q8_0", "Q4_0", "Q4_K_M")


@dataclass(slots=True)
class LlamaCpp:
    bin_dir: Path

    @classmethod
    def find(cls, flag: str | None) -> "LlamaCpp | None":
        d = flag or os.environ.get("KVYARD_LLAMA_CPP")
        if not d:
            return None
        p = Path(d)
        for cand in (p, p / "bin", p / "build" / "bin"):
            if all((cand / n).exists() for n in ("llama-quantize", "llama-perplexity", "llama-server")):
                return cls(cand)
        return None

    def quantize(self, src: Path, qtype: str, out_dir: Path) -> Path:
        out = out_dir / f"demo-{qtype}.gguf"
        if not out.exists():
            subprocess.run([str(self.bin_dir / "llama-quantize"), "--allow-requantize", str(src), str(out), qtype],
                           check=True, capture_output=True, timeout=600)
        return out

    def perplexity(self, gguf: Path, text: Path, ctx: int, threads: int) -> float:
        r = subprocess.run([str(self.bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text),
                            "-c", str(ctx), "-t", str(threads), "-b", str(ctx)],
                           capture_output=True, text=True, timeout=1800)
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
        if not m:
            raise RuntimeError(f"llama-perplexity: no estimate ({(r.stdout + r.stderr)[-500:]})")
        return float(m.group(1))

    def server(self, gguf: Path, threads: int, slots: int, ctx: int) -> Server:
        port = procs.free_port()
        cmd = [str(self.bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-np", str(slots), "-c", str(ctx * slots), "--no-webui",
               "--threads-http", str(slots + 2)]  # one HTTP thread per stream: the default (cores) drops c32's
        return Server(f"llama-server-{gguf.stem}", cmd, port)


def workdir() -> Path:
    d = Path(os.environ.get("KVYARD_CACHE_DIR") or Path.home() / ".cache" / "kvyard") / "bench-quant"
    d.mkdir(parents=True, exist_ok=True)
    return d if os.access(d, os.W_OK) else Path(tempfile.mkdtemp(prefix="kvyard-quant-"))
