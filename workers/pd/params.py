"""`kv_transfer_params` as llm-d and vLLM spell them, plus what kvyard adds.

The prefill leg is the client's body with `stream: false`, `stream_options`
removed, the token limits forced to 1, `n` 1 and vLLM's request-side
`kv_transfer_params` (`do_remote_decode: true`; kvyard adds `kvyard.stream_id`,
the decode worker's name for the hold, so it can pull the blocks while the
prompt still computes: peer_stream.py). The prefill worker answers
with vLLM's response-side fields (`remote_block_ids`, `remote_engine_id`,
`remote_request_id`, `remote_host`, `remote_port`, `tp_size`) and, under
`"kvyard"`, what a kvyard decode worker checks before it trusts a block: the
KV namespace (model identity + KV layout digest: a handoff between
mismatched models, dtypes or block sizes is refused) and each block's chained
hash (the decode side keeps only the leading blocks whose hashes equal its
own tokenization's), and `shm` when the hold can also be pulled through a
same-host memfd (peer_shm.py).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from kvyard.common.wire import KV_TRANSFER_PARAMS

REQUEST_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None,
                  "remote_host": None, "remote_port": None}
_ONE = ("max_tokens", "max_completion_tokens", "min_tokens")
_STREAM_ID = re.compile(r"[0-9a-f]{32}")


def prefill_leg_body(body: dict[str, Any], stream_id: str | None = None) -> dict[str, Any]:
    """The body the decode worker sends the prefill worker (llm-d's pd-sidecar's);
    `stream_id` names the hold so it can be pulled while the prompt computes."""
    out = copy.deepcopy(body)
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    for name in _ONE[1:]:
        if name in out:
            out[name] = 1
    if "n" in out:
        out["n"] = 1
    out[KV_TRANSFER_PARAMS] = dict(REQUEST_PARAMS)
    if stream_id is not None:
        out[KV_TRANSFER_PARAMS]["kvyard"] = {"stream_id": stream_id}
    return out


def stream_id_of(body: dict[str, Any]) -> str | None:
    """The decode worker's name for the hold (32 hex digits, a uuid4), if it sent one."""
    ktp = body.get(KV_TRANSFER_PARAMS)
    ky = ktp.get("kvyard") if isinstance(ktp, dict) else None
    sid = ky.get("stream_id") if isinstance(ky, dict) else None
    return sid if isinstance(sid, str) and _STREAM_ID.fullmatch(sid) else None


def wants_remote_decode(body: dict[str, Any]) -> bool:
    ktp = body.get(KV_TRANSFER_PARAMS)
    return isinstance(ktp, dict) and ktp.get("do_remote_decode") is True


@dataclass(slots=True)
class Offer:
    """A prefill worker's answer: where its held blocks are and what they are."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[int]
    block_hashes: list[int]
    block_size: int
    kv_namespace: str          # hex digest of kvstore.layout.Namespace
    shm: bool = False          # a same-host endpoint serves this hold too (peer_shm.py)

    def to_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": self.remote_block_ids,
                "remote_engine_id": self.remote_engine_id,
                "remote_request_id": self.remote_request_id,
                "remote_host": self.remote_host, "remote_port": self.remote_port,
                "tp_size": 1,
                "kvyard": {"block_size": self.block_size, "kv_namespace": self.kv_namespace,
                           "block_hashes": [f"{h:032x}" for h in self.block_hashes],
                           "shm": self.shm}}

    @classmethod
    def from_params(cls, p: Any) -> "Offer":
        """ValueError unless `p` is a complete kvyard offer."""
        if not isinstance(p, dict) or p.get("do_remote_prefill") is not True:
            raise ValueError("no do_remote_prefill offer")
        ky = p.get("kvyard")
        if not isinstance(ky, dict):
            raise ValueError("not a kvyard prefill worker (no 'kvyard' field)")
        try:
            ids = [int(b) for b in p["remote_block_ids"]]
            hashes = [int(h, 16) for h in ky["block_hashes"]]
            offer = cls(str(p["remote_engine_id"]), str(p["remote_request_id"]),
                        str(p["remote_host"]), int(p["remote_port"]), ids, hashes,
                        int(ky["block_size"]), str(ky["kv_namespace"]), ky.get("shm") is True)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed kv_transfer_params: {e}") from None
        if len(ids) != len(hashes) or not 0 < offer.remote_port < 65536:
            raise ValueError("malformed kv_transfer_params: block ids, hashes or port")
        return offer
