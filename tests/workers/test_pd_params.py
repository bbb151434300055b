"""P/D wire pieces without a model: the prefill leg's body (llm-d's), the offer's fields
(vLLM's names) and their validation."""
from __future__ import annotations

import pytest

from kvyard.workers.pd.params import REQUEST_PARAMS, Offer, prefill_leg_body, wants_remote_decode


def test_prefill_leg_is_llm_d_shaped() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 200,
            "max_completion_tokens": 300, "min_tokens": 5, "n": 1, "temperature": 0.3}
    leg = prefill_leg_body(body)
    assert leg["stream"] is False and "stream_options" not in leg
    assert leg["max_tokens"] == leg["max_completion_tokens"] == leg["min_tokens"] == 1
    assert leg["n"] == 1 and leg["temperature"] == 0.3 and leg["messages"] == body["messages"]
    assert leg["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert body["stream"] is True and body["max_tokens"] == 200  # the client's body untouched
    assert wants_remote_decode(leg) and not wants_remote_decode(body)
    bare = prefill_leg_body({"prompt": "x"})
    assert bare["max_tokens"] == 1 and "min_tokens" not in bare and "n" not in bare
    assert REQUEST_PARAMS["do_remote_decode"] is True


def test_offer_round_trip_with_vllm_names() -> None:
    o = Offer("eng", "req-1", "10.0.0.5", 41000, [7, 8, 9], [1, 2, (1 << 128) - 1], 16, "ab" * 16)
    p = o.to_params()
    assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False
    assert p["tp_size"] == 1 and p["remote_block_ids"] == [7, 8, 9]
    assert {"remote_engine_id", "remote_request_id", "remote_host", "remote_port"} <= set(p)
    assert Offer.from_params(p) == o


@pytest.mark.parametrize("bad", [
    None, {}, {"do_remote_prefill": False},
    {"do_remote_prefill": True, "remote_block_ids": [1]},            # not kvyard's
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
     "remote_host": "h", "remote_port": 0, "remote_block_ids": [1],
     "kvyard": {"block_size": 16, "kv_namespace": "x", "block_hashes": ["01"]}},  # port 0
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
     "remote_host": "h", "remote_port": 1, "remote_block_ids": [1, 2],
     "kvyard": {"block_size": 16, "kv_namespace": "x", "block_hashes": ["01"]}},  # counts
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
     "remote_host": "h", "remote_port": 1, "remote_block_ids": [1],
     "kvyard": {"block_size": 16, "kv_namespace": "x", "block_hashes": ["zz"]}},  # not hex
])
def test_bad_offers_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        Offer.from_params(bad)


def test_transport_flag() -> None:
    import argparse

    from kvyard.workers.pd.flags import add_pd_arguments

    p = argparse.ArgumentParser()
    add_pd_arguments(p)
    assert p.parse_args([]).pd_transports == ("shm", "tcp")
    assert p.parse_args(["--pd-transports", "tcp"]).pd_transports == ("tcp",)
    assert p.parse_args(["--pd-transports", "tcp,shm"]).pd_transports == ("tcp", "shm")
    assert p.parse_args(["--pd-transports", "none"]).pd_transports == ()
    for bad in ("udp", "tcp,tcp", "", "none,tcp"):
        with pytest.raises(SystemExit):
            p.parse_args(["--pd-transports", bad])
