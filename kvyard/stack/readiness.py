"""When a started process counts as ready: a service's `ready` string, and the EPP
seeing its workers."""
from __future__ import annotations

import json
from typing import Callable

from kvyard.stack import procs
from kvyard.stack.endpoints_file import parse_endpoints


def ready_check(ready: str) -> Callable[[], bool]:
    if ready.startswith("tcp:"):
        port = int(ready[4:])
        return lambda: procs.tcp_ok(port)
    return lambda: procs.http_ok(ready)


def epp_sees(metrics_url: str, n: int) -> Callable[[], bool]:
    """Ready once the EPP's /debug/endpoints lists at least `n` freshly scraped
    endpoints and its tokenizer has loaded: before that it hashes prompts as
    bytes, so a prefix routed then would not match the same prefix routed later."""
    def check() -> bool:
        code, body = procs.http_get(metrics_url + "/debug/endpoints")
        doc = json.loads(body) if code == 200 else {}
        if isinstance(doc, dict) and doc.get("tokenizer") == "loading":
            return False
        rows = parse_endpoints(doc)
        return sum(1 for r in rows if r.get("fresh", True)) >= n
    return check
