"""KEDA's external scaler protocol: `pb2` (messages) and `pb2_grpc` (service stubs).

The EPP serves `externalscaler.ExternalScaler` (epp/scaler/server.py) and the local
autoscaler is a client of it, so the stubs live here, in the neutral module.
They are generated from `externalscaler.proto` (KEDA's file, verbatim in shape)
with grpcio-tools the first time this package is imported, into
`$KVYARD_CACHE_DIR/keda/<key>` (default ~/.cache/kvyard), where the key hashes
the proto and the generator and runtime versions, so an edited proto or an
upgraded protobuf regenerates and a stale copy is never loaded. Generated code
is never committed. A cache that cannot be written (read-only root fs,
a user without a home) falls back to the temp dir.

Generation writes into a fresh directory and renames it into place, so
processes importing concurrently never see half-written files. The generated
modules are found through this package's `__path__` (they are
`kvyard.common.keda.externalscaler_pb2[_grpc]`), because protoc is run with the
proto at `kvyard/common/keda/` and its `_grpc` module imports the messages by
that absolute name.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import tempfile
from pathlib import Path

PROTO = Path(__file__).with_name("externalscaler.proto")
SERVICE = "externalscaler.ExternalScaler"
_PKG = ("kvyard", "common", "keda")


def _key(proto: bytes) -> str:
    import google.protobuf

    versions = f"{google.protobuf.__version__}/{_dist_version('grpcio-tools')}"
    return hashlib.sha256(proto + b"\0" + versions.encode()).hexdigest()[:16]


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def _bases() -> list[Path]:
    env = os.environ.get("KVYARD_CACHE_DIR")
    home = Path(env) if env else Path(os.path.expanduser("~")) / ".cache" / "kvyard"
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return [home / "keda", Path(tempfile.gettempdir()) / f"kvyard-{uid}" / "keda"]


def _generate(proto: bytes, out: Path) -> None:
    """protoc into `out` (absent), through a sibling temp dir renamed into place."""
    from grpc_tools import protoc

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out.parent, prefix=".gen-"))
    try:
        src = work / "src"
        (src.joinpath(*_PKG)).mkdir(parents=True)
        (src.joinpath(*_PKG) / PROTO.name).write_bytes(proto)
        gen = work / "gen"
        gen.mkdir()
        include = Path(protoc.__file__).parent / "_proto"  # well-known types, for completeness
        rc = protoc.main(["grpc_tools.protoc", f"-I{src}", f"-I{include}",
                          f"--python_out={gen}", f"--grpc_python_out={gen}",
                          "/".join((*_PKG, PROTO.name))])
        mods = gen.joinpath(*_PKG)
        if rc != 0 or not (mods / "externalscaler_pb2_grpc.py").exists():
            raise RuntimeError(f"grpc_tools.protoc failed on {PROTO} (exit {rc})")
        try:
            os.rename(mods, out)
        except OSError:
            if not (out / "externalscaler_pb2_grpc.py").exists():  # not a lost race: a failure
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stub_dir() -> Path:
    """The directory holding the generated modules, generating them if needed."""
    proto = PROTO.read_bytes()
    key = _key(proto)
    errors = []
    for base in _bases():
        out = base / key
        if (out / "externalscaler_pb2_grpc.py").exists():
            return out
        try:
            _generate(proto, out)
            return out
        except OSError as e:
            errors.append(f"{base}: {e}")
    raise RuntimeError("cannot write the KEDA stubs anywhere: " + "; ".join(errors))


__path__.append(str(stub_dir()))  # noqa: F821 - a package's own __path__
pb2 = importlib.import_module(f"{__name__}.externalscaler_pb2")
pb2_grpc = importlib.import_module(f"{__name__}.externalscaler_pb2_grpc")

__all__ = ["pb2", "pb2_grpc", "PROTO", "SERVICE", "stub_dir"]
