"""Peer routers for `kvyard bench route`: SGLang's Shepherd Model Gateway (`smg`) and
vLLM's router (`vllm-router`), both Rust, each fronting the same pods the EPP does.

Each is looked up in its own virtual environment under `.peers/<package>/` (made
by `kvyard bench route --install-peers`, which runs `pip install` there) or on
PATH; a peer that is absent is reported as "not installed", never an error.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvyard.stack import procs

PEERS_DIR = Path(".peers")


@dataclass(slots=True, frozen=True)
class Peer:
    """One peer configuration: `name` is its key in the report (e.g. smg:cache_aware)."""

    name: str
    package: str
    binary: str
    args: tuple[str, ...]
    needs_kv_events: bool = False

    def executable(self, root: Path = PEERS_DIR) -> str | None:
        local = root / self.package / "bin" / self.binary
        return str(local.resolve()) if local.exists() else shutil.which(self.binary)

    def command(self, exe: str, port: int, prom_port: int, addresses: list[str],
                kv_events: dict[str, str] | None = None, model: str | None = None) -> list[str]:
        urls = [f"http://{a}" for a in addresses]
        # Both bind a Prometheus port of their own (a fixed default: two peers collide).
        cmd = [exe, *(["launch"] if self.package == "smg" else []), "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-port", str(prom_port),
               "--worker-urls", *urls, *self.args]
        if self.needs_kv_events:
            for addr, endpoint in (kv_events or {}).items():
                cmd += ["--kv-event-source", f"http://{addr}={endpoint}"]
            if model:
                cmd += ["--kv-event-model", model]
        return cmd


PEERS: tuple[Peer, ...] = (
    # smg's event-driven index (--kv-index) has no flag naming a vLLM ZMQ publisher, so
    # its cache_aware here is the approximate radix tree it builds from its own routing.
    Peer("smg:cache_aware", "smg", "smg", ("--policy", "cache_aware", "--backend", "vllm")),
    Peer("vllm-router:cache_aware", "vllm-router", "vllm-router", ("--policy", "cache_aware")),
    # Fed by the pods' KV events (ZMQ): only when the pods publish them.
    Peer("vllm-router:kv_aware", "vllm-router", "vllm-router",
         ("--policy", "kv_aware", "--kv-event-block-size", "16"), needs_kv_events=True),
)


def install(packages: list[str], root: Path = PEERS_DIR) -> dict[str, str]:
    """`pip install` each package into a virtual environment of its own; a failure
    is returned as text, not raised (no network: the bench runs without peers)."""
    out = {}
    for pkg in packages:
        venv = root / pkg
        try:
            if not (venv / "bin" / "pip").exists():
                subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True,
                               capture_output=True, timeout=300)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", pkg], check=True,
                           capture_output=True, timeout=600)
            out[pkg] = "installed"
        except (subprocess.SubprocessError, OSError) as e:
            out[pkg] = f"install failed: {e}"
    return out


@dataclass(slots=True)
class RunningPeer:
    peer: Peer
    proc: procs.Proc
    url: str
    notes: list[str] = field(default_factory=list)


def start(peer: Peer, addresses: list[str], log_dir: Path, kv_events: dict[str, str] | None,
          model: str | None = None, timeout_s: float = 120.0) -> RunningPeer | str:
    """The peer running in front of `addresses`, ready to route; or why it is not."""
    exe = peer.executable()
    if exe is None:
        return "not installed"
    if peer.needs_kv_events and not kv_events:
        return "unavailable (the pods publish no KV events)"
    taken: set[int] = set()
    port, prom = procs.free_port(None, taken), procs.free_port(None, taken)
    p = procs.spawn(peer.name.replace(":", "-"),
                    peer.command(exe, port, prom, addresses, kv_events, model),
                    log_dir / f"{peer.name.replace(':', '-')}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        # Both answer /health once they run; /v1/models once a worker is registered.
        procs.wait_ready([(p, lambda: procs.http_ok(url + "/v1/models", 2.0))], timeout_s)
    except Exception as e:  # noqa: BLE001 - a peer that will not start is a row, not a crash
        procs.stop([p.pid])
        return f"failed to start: {str(e)[-300:]}"
    return RunningPeer(peer, p, url)


# Log lines that say a peer ran without what its policy needs, and what they mean.
LOG_SIGNS = {
    "KV event batch must be an array": "it could not decode the pods' KV-event batches "
                                       "(it wants vLLM's positional msgpack form), so its "
                                       "KV index stayed empty",
    "KV event must be a tagged map": "it could not decode the pods' KV events (it wants "
                                     "newer vLLM's maps tagged \"type\" in a positional "
                                     "batch), so its KV index stayed empty",
}


def log_notes(running: RunningPeer) -> list[str]:
    """What the peer's log says went wrong, once per kind (counted)."""
    try:
        text = Path(running.proc.log).read_text(errors="replace")
    except OSError:
        return []
    return [f"{meaning} ({text.count(sign)} log lines)" for sign, meaning in LOG_SIGNS.items()
            if sign in text]


def stop(running: RunningPeer) -> None:
    procs.stop([running.proc.pid])
