"""TLS on the EPP's cross-pod gRPC servers (epp/tls.py): the scaler and ext_proc answer
over TLS with a certificate from a throwaway CA, a plaintext client gets nowhere, a client
CA makes it mutual, and a renewed certificate is served without a restart."""
from __future__ import annotations

import asyncio
import os
import shutil

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvyard.common import keda
from kvyard.epp.cli import config_from_args
from kvyard.epp.tls import tls_files

pb2 = keda.pb2


def _creds(certs, ca: str = "ca", client: bool = False) -> grpc.ChannelCredentials:
    key = certs["client_key"].read_bytes() if client else None
    chain = certs["client_cert"].read_bytes() if client else None
    return grpc.ssl_channel_credentials(certs[ca].read_bytes(), key, chain)


def _ref(app) -> "pb2.ScaledObjectRef":
    return pb2.ScaledObjectRef(name="workers", namespace="ns", scalerMetadata={
        "pool": app.cfg.pool_name, "role": "both"})


async def _tls_epp(epp, certs, **kw):
    return await epp([], scaler_port=0, tls_cert_file=str(certs["server_cert"]),
                     tls_key_file=str(certs["server_key"]), **kw)


async def test_scaler_and_ext_proc_serve_tls_and_refuse_plaintext(epp, tls_certs):
    app = await _tls_epp(epp, tls_certs)
    target = f"localhost:{app.ports['scaler']}"
    async with grpc.aio.secure_channel(target, _creds(tls_certs)) as ch:
        stub = keda.pb2_grpc.ExternalScalerStub(ch)
        assert (await stub.IsActive(_ref(app), timeout=10)).result is False
        spec = await stub.GetMetricSpec(_ref(app), timeout=10)
        assert spec.metricSpecs[0].metricName == f"kvyard-{app.cfg.pool_name}-both"
    async with grpc.aio.insecure_channel(target) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await keda.pb2_grpc.ExternalScalerStub(ch).IsActive(_ref(app), timeout=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # A CA that did not sign the server's certificate: the handshake fails.
    async with grpc.aio.secure_channel(target, _creds(tls_certs, "other_ca")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await keda.pb2_grpc.ExternalScalerStub(ch).IsActive(_ref(app), timeout=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # ext_proc (and EDS) share the TLS port: a routed request over a secure channel.
    ext = f"localhost:{app.ports['ext_proc']}"
    async with grpc.aio.insecure_channel(ext) as ch:
        call = ep_grpc.ExternalProcessorStub(ch).Process(timeout=3)
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
    async with grpc.aio.secure_channel(ext, _creds(tls_certs)) as ch:
        await asyncio.wait_for(ch.channel_ready(), 10)


async def test_client_ca_makes_it_mutual(epp, tls_certs):
    app = await _tls_epp(epp, tls_certs, tls_client_ca_file=str(tls_certs["ca"]))
    target = f"localhost:{app.ports['scaler']}"
    async with grpc.aio.secure_channel(target, _creds(tls_certs)) as ch:  # no client cert
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await keda.pb2_grpc.ExternalScalerStub(ch).IsActive(_ref(app), timeout=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.secure_channel(target, _creds(tls_certs, client=True)) as ch:
        assert (await keda.pb2_grpc.ExternalScalerStub(ch).IsActive(
            _ref(app), timeout=10)).result is False


async def test_a_renewed_certificate_is_served_without_a_restart(epp, tls_certs, tmp_path):
    """The files change in place (a Secret volume's update): new connections get the new
    certificate, here one from another CA."""
    other = tmp_path / "other"
    other.mkdir()
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(tls_certs["server_cert"], cert)
    shutil.copy(tls_certs["server_key"], key)
    app = await epp([], scaler_port=0, tls_cert_file=str(cert), tls_key_file=str(key))
    target = f"localhost:{app.ports['scaler']}"
    async with grpc.aio.secure_channel(target, _creds(tls_certs)) as ch:
        assert (await keda.pb2_grpc.ExternalScalerStub(ch).IsActive(
            _ref(app), timeout=10)).result is False
    # The client certificate (signed by the same CA, no server name) swapped in: a client
    # that checks the name now fails, which shows the server reloaded it.
    shutil.copy(tls_certs["client_cert"], cert)
    shutil.copy(tls_certs["client_key"], key)
    st = os.stat(cert)
    os.utime(cert, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    async with grpc.aio.secure_channel(target, _creds(tls_certs)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await keda.pb2_grpc.ExternalScalerStub(ch).IsActive(_ref(app), timeout=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_flags_reach_the_config_and_half_a_pair_is_refused():
    import argparse

    from kvyard.epp.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--tls-cert-file", "c", "--tls-key-file", "k",
                                         "--tls-client-ca-file", "ca"]))
    assert (cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file) == ("c", "k", "ca")
    assert config_from_args(p.parse_args([])).tls_cert_file is None
    assert tls_files(None, None) is None
    for bad in (("c", None, None), (None, "k", None), (None, None, "ca")):
        with pytest.raises(ValueError):
            tls_files(*bad)
