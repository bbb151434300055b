"""Who may a decode worker ask to prefill for it? Only a pod the EPP chose.

The EPP signs its `x-prefiller-host-port` answer with a key it shares with the
pool's workers (a Kubernetes Secret; a 0600 file in the local stack):
`x-kvyard-prefiller-auth: <expiry unix seconds>.<hex HMAC-SHA256 of
"<host:port>|<expiry>">`. A decode worker connects to a prefill target only
if the signature verifies and has not expired; anything else is a 403 and no
connection is ever made. So a client cannot point a worker at an arbitrary
host (SSRF) even if a gateway failed to strip the header, and the worker
needs no discovery of its own. Both headers are routing headers: the
gateway removes client copies before any filter runs.

Why a signature rather than the worker watching pool membership: the worker
stays free of discovery code and Kubernetes permissions, and the check costs
one HMAC. A worker without a key accepts no prefill target at all.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import time
from pathlib import Path

KEY_ENV = "KVYARD_PD_KEY_FILE"
TTL_S = 60.0  # a decision is used within milliseconds; a minute tolerates clock skew


def load_key(path: str | os.PathLike | None = None) -> bytes | None:
    """The shared key from `path` (or $KVYARD_PD_KEY_FILE); None when neither is set."""
    p = path or os.environ.get(KEY_ENV)
    if not p:
        return None
    key = Path(p).read_bytes().strip()
    if len(key) < 16:
        raise ValueError(f"{p}: the P/D key must be at least 16 bytes")
    return key


def _mac(key: bytes, target: str, expiry: int) -> str:
    return hmac.new(key, f"{target}|{expiry}".encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, target: str, now: float | None = None, ttl_s: float = TTL_S) -> str:
    expiry = int((time.time() if now is None else now) + ttl_s)
    return f"{expiry}.{_mac(key, target, expiry)}"


def verify(key: bytes | None, target: str, token: str | None, now: float | None = None) -> str | None:
    """None if `token` authorises `target`; else why not (for the 403 and its counter)."""
    if key is None:
        return "this worker has no P/D key: it accepts no prefill target"
    if not token:
        return "unsigned prefill target"
    expiry_s, _, mac = token.partition(".")
    if not expiry_s.isdigit() or not mac:
        return "malformed prefill signature"
    if int(expiry_s) < (time.time() if now is None else now):
        return "expired prefill signature"
    if not hmac.compare_digest(mac, _mac(key, target, int(expiry_s))):
        return "bad prefill signature"
    return None
