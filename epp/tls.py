"""TLS for the EPP's gRPC servers that cross pods: ext_proc (with EDS, Envoy's) and the
KEDA scaler (KEDA's operator). Off unless a certificate is given; the health port stays
plaintext (the kubelet's gRPC probes speak no TLS).

The files are read again when they change (a Secret volume is updated in place, e.g.
when cert-manager renews the certificate): gRPC asks `_fetch` at each handshake, which
compares modification times and hands back a new configuration only on a change, so
connections already open keep theirs and new ones get the new certificate without a
restart. With a client CA, clients must present a certificate it signed (mutual TLS).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import grpc

log = logging.getLogger("kvyard.epp")


@dataclass(slots=True)
class TlsFiles:
    cert_file: str
    key_file: str
    client_ca_file: str | None = None  # set: mutual TLS, clients need a certificate it signed
    _stamp: tuple = field(default=(), init=False, repr=False)

    def _paths(self) -> list[str]:
        return [p for p in (self.cert_file, self.key_file, self.client_ca_file) if p]

    def _mtimes(self) -> tuple:
        return tuple(os.stat(p).st_mtime_ns for p in self._paths())

    def _config(self) -> grpc.ServerCertificateConfiguration:
        with open(self.key_file, "rb") as f:
            key = f.read()
        with open(self.cert_file, "rb") as f:
            chain = f.read()
        ca = None
        if self.client_ca_file:
            with open(self.client_ca_file, "rb") as f:
                ca = f.read()
        return grpc.ssl_server_certificate_configuration([(key, chain)], ca)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """None: keep the current configuration (gRPC's contract for the fetcher)."""
        try:
            stamp = self._mtimes()
            if stamp == self._stamp:
                return None
            cfg = self._config()
        except OSError as e:  # mid-update (a Secret's symlink swap): keep serving the old one
            log.warning("TLS files unreadable (%s); keeping the current certificate", e)
            return None
        self._stamp = stamp
        log.info("TLS certificate (re)loaded from %s", self.cert_file)
        return cfg

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that follow the files; a missing file fails here, at start."""
        self._stamp = self._mtimes()
        return grpc.dynamic_ssl_server_credentials(
            self._config(), self._fetch,
            require_client_authentication=self.client_ca_file is not None)


def tls_files(cert_file: str | None, key_file: str | None,
              client_ca_file: str | None = None) -> TlsFiles | None:
    """None without a certificate (plaintext); a key or CA without one is an error."""
    if not cert_file and not key_file:
        if client_ca_file:
            raise ValueError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
        return None
    if not (cert_file and key_file):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    return TlsFiles(cert_file, key_file, client_ca_file)
