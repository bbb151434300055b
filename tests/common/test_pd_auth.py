"""The EPP's signature over a prefill target, as the decode worker checks it."""
from __future__ import annotations

import pytest

from kvyard.common import pd_auth

KEY = b"0123456789abcdef0123"


def test_sign_and_verify():
    tok = pd_auth.sign(KEY, "10.0.0.7:8000", now=1000.0)
    assert pd_auth.verify(KEY, "10.0.0.7:8000", tok, now=1030.0) is None
    assert pd_auth.verify(KEY, "10.0.0.7:8001", tok, now=1030.0) == "bad prefill signature"
    assert pd_auth.verify(KEY, "10.0.0.7:8000", tok, now=1061.0) == "expired prefill signature"
    assert pd_auth.verify(None, "10.0.0.7:8000", tok) is not None
    assert pd_auth.verify(KEY, "10.0.0.7:8000", None) == "unsigned prefill target"
    assert pd_auth.verify(KEY, "10.0.0.7:8000", "garbage") == "malformed prefill signature"
    exp = tok.split(".")[0]
    assert pd_auth.verify(KEY, "10.0.0.7:8000", f"{int(exp) + 99}.{tok.split('.')[1]}",
                          now=1030.0) == "bad prefill signature"  # the expiry is signed too


def test_key_files(tmp_path, monkeypatch):
    (tmp_path / "k").write_bytes(KEY + b"\n")
    assert pd_auth.load_key(tmp_path / "k") == KEY
    monkeypatch.setenv(pd_auth.KEY_ENV, str(tmp_path / "k"))
    assert pd_auth.load_key() == KEY
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(ValueError):
        pd_auth.load_key(tmp_path / "short")
    monkeypatch.delenv(pd_auth.KEY_ENV)
    assert pd_auth.load_key() is None
