"""Fixtures every component's tests share: free ports, deadlines, the demo model.

Tests start and stop their own servers on free loopback ports and poll with
deadlines; nothing sleeps to synchronise.
"""
from __future__ import annotations

import os

# Before torch loads anywhere in the session: spinning OpenMP threads starve
# the servers' own threads on small machines (see kvyard/cli.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import time
from pathlib import Path
from typing import Callable

import pytest

from kvyard.stack.procs import free_port as _any_free_port


# Ports handed out in this session: a port is released as soon as it is known, so the
# kernel may offer the same one to the next call, and one test's two servers would share
# it (seen in CI).
_GIVEN: set[int] = set()


def _free_port() -> int:
    return _any_free_port(taken=_GIVEN)


@pytest.fixture
def free_port() -> Callable[[], int]:
    return _free_port


def _wait_until(pred: Callable[[], object], timeout: float = 30.0, interval: float = 0.02,
                what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - keep polling until the deadline
            last_exc = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}: {last_exc!r}")


@pytest.fixture
def wait_until() -> Callable[..., object]:
    return _wait_until


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    from kvyard.common.models import demo_gguf_path

    return demo_gguf_path()


@pytest.fixture(scope="session")
def tls_certs(tmp_path_factory) -> dict[str, Path]:
    """A throwaway CA, a server certificate for localhost/127.0.0.1 and a client
    certificate, made with the openssl CLI (paths: ca, server_cert, server_key,
    client_cert, client_key, other_ca: a CA that signed none of them)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI")
    d = tmp_path_factory.mktemp("tls")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    for ca in ("ca", "other_ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", f"/CN=kvyard test {ca}", "-keyout", f"{ca}.key", "-out", f"{ca}.crt")
    exts = {"server": "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                      "extendedKeyUsage=serverAuth\n",
            "client": "extendedKeyUsage=clientAuth\n"}
    for who, ext in exts.items():
        (d / f"{who}.ext").write_text(ext)
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
            "-keyout", f"{who}.key", "-out", f"{who}.csr")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{who}.ext", "-out", f"{who}.crt")
    return {"ca": d / "ca.crt", "other_ca": d / "other_ca.crt",
            "server_cert": d / "server.crt", "server_key": d / "server.key",
            "client_cert": d / "client.crt", "client_key": d / "client.key"}
