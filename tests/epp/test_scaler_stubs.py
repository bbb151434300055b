"""The KEDA stubs in kvyard.common.keda: generated from the proto, cached, usable anywhere."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvyard.common import keda


def test_stubs_match_keda_proto_facts():
    svc = keda.pb2.DESCRIPTOR.services_by_name["ExternalScaler"]
    assert svc.full_name == keda.SERVICE == "externalscaler.ExternalScaler"
    assert [m.name for m in svc.methods] == ["IsActive", "StreamIsActive", "GetMetricSpec",
                                            "GetMetrics"]
    assert svc.methods_by_name["StreamIsActive"].server_streaming
    fields = {m: {f.name: f.number for f in keda.pb2.DESCRIPTOR.message_types_by_name[m].fields}
              for m in ("ScaledObjectRef", "MetricSpec", "GetMetricsRequest", "MetricValue")}
    assert fields == {
        "ScaledObjectRef": {"name": 1, "namespace": 2, "scalerMetadata": 3},
        "MetricSpec": {"metricName": 1, "targetSize": 2, "targetSizeFloat": 3},
        "GetMetricsRequest": {"scaledObjectRef": 1, "metricName": 2},
        "MetricValue": {"metricName": 1, "metricValue": 2, "metricValueFloat": 3}}
    ref = keda.pb2.ScaledObjectRef(name="n", scalerMetadata={"pool": "p"})
    assert keda.pb2.ScaledObjectRef.FromString(ref.SerializeToString()).scalerMetadata["pool"] == "p"
    assert not any(Path(keda.__file__).parent.glob("*_pb2*.py"))  # never beside the proto


def _import_in(env_extra: dict[str, str]) -> str:
    env = {**os.environ, **env_extra}
    r = subprocess.run([sys.executable, "-c",
                        "from kvyard.common import keda; keda.pb2_grpc.ExternalScalerStub;"
                        "print(keda.stub_dir())"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_generated_once_into_the_cache_and_reused(tmp_path):
    cache = tmp_path / "cache"
    first = Path(_import_in({"KVYARD_CACHE_DIR": str(cache)}))
    assert first.parent == cache / "keda" and (first / "externalscaler_pb2_grpc.py").exists()
    stamp = (first / "externalscaler_pb2.py").stat().st_mtime_ns
    assert Path(_import_in({"KVYARD_CACHE_DIR": str(cache)})) == first
    assert (first / "externalscaler_pb2.py").stat().st_mtime_ns == stamp
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".gen-")]


def test_unwritable_cache_falls_back_to_the_temp_dir(tmp_path):
    # /proc refuses mkdir even for root, like a read-only root fs for a non-root user.
    got = Path(_import_in({"KVYARD_CACHE_DIR": "/proc/kvyard-no-such-dir",
                           "TMPDIR": str(tmp_path)}))
    assert got.is_relative_to(tmp_path) and (got / "externalscaler_pb2.py").exists()


def test_concurrent_first_imports_agree(tmp_path):
    env = {**os.environ, "KVYARD_CACHE_DIR": str(tmp_path)}
    code = "from kvyard.common import keda; print(keda.stub_dir())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    assert len({o.strip() for o, _ in outs}) == 1
    assert [p.name for p in (tmp_path / "keda").iterdir()] == [Path(outs[0][0].strip()).name]
