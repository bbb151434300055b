"""The component boundaries of docs/ARCHITECTURE.md, checked by importing every
module of a component in a fresh interpreter and looking at what came along."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import importlib, json, pkgutil, sys
pkg = importlib.import_module(sys.argv[1])
for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    importlib.import_module(m.name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_by(package: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, package], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def top(mods: set[str], prefix: str) -> list[str]:
    return sorted(m for m in mods if m == prefix or m.startswith(prefix + "."))


@pytest.mark.parametrize("package, forbidden", [
    # The EPP starts fast and ships small: no torch, no transformers, no worker code.
    ("kvyard.epp", ["torch", "transformers", "kvyard.workers"]),
    # The kvstore knows blocks and bytes, not the engine.
    ("kvyard.kvstore", ["torch", "transformers", "kvyard.workers", "kvyard.epp"]),
    # The neutral module is imported by everyone, so it imports none of them.
    ("kvyard.common", ["torch", "transformers", "kvyard.workers", "kvyard.epp", "kvyard.kvstore"]),
    # Workers never import the EPP.
    ("kvyard.workers", ["kvyard.epp"]),
    # The operator renders manifests; what it shares with the EPP and the workers is in
    # kvyard.common (and the gateway's config module), never their internals.
    ("kvyard.operator", ["torch", "transformers", "kvyard.workers", "kvyard.epp",
                         "kvyard.kvstore"]),
])
def test_component_does_not_import(package: str, forbidden: list[str]) -> None:
    mods = loaded_by(package)
    assert package in mods  # the probe really imported it
    leaked = {f: top(mods, f)[:3] for f in forbidden if top(mods, f)}
    assert not leaked, f"{package} pulls in {leaked}"
