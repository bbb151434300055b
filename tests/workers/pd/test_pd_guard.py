"""The decode worker's SSRF guard: a prefill target the EPP did not sign (unsigned,
expired, another key, another target) is a 403 and is never contacted."""
from __future__ import annotations

import secrets
import socket
import time

import pytest

from kvyard.common import pd_auth, wire


def test_forged_targets_are_never_contacted(pdh, decode, prefill, key_file) -> None:
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.setblocking(False)
    target = f"127.0.0.1:{trap.getsockname()[1]}"
    other_key = pd_auth.sign(secrets.token_bytes(32), target)
    forged = [{wire.PREFILLER_HEADER: target},
              {wire.PREFILLER_HEADER: target, wire.PREFILLER_AUTH_HEADER: "9999999999.00ff"},
              {wire.PREFILLER_HEADER: target, wire.PREFILLER_AUTH_HEADER: other_key},
              # a real signature, for another target
              {wire.PREFILLER_HEADER: target,
               wire.PREFILLER_AUTH_HEADER: pdh.signed(key_file, pdh.prefill_address(prefill))[
                   wire.PREFILLER_AUTH_HEADER]},
              {wire.PREFILLER_HEADER: target,
               wire.PREFILLER_AUTH_HEADER: pd_auth.sign(pd_auth.load_key(key_file), target,
                                                        now=time.time() - 3600)}]
    before = pdh.scrape(decode.base_url)[wire.M_PD_REJECTED]
    try:
        for headers in forged:
            status, doc = pdh.post(decode.base_url, pdh.body("Is this a trap?"), headers)
            assert status == 403, doc
            assert doc["error"]["code"] == "prefill_target_refused"
            assert doc["error"]["type"] == "permission_error"
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody ever connected
    finally:
        trap.close()
    assert pdh.scrape(decode.base_url)[wire.M_PD_REJECTED] == before + len(forged)
