"""What one hostile request costs a worker (issue 15's numbers), measured on a live worker.

- A normal short completion's latency while another client sends a stop-string
  request (20,000 strings of ~55 characters: refused; 128 of 512, the cap: served),
  once or back to back, against the same request alone, in interleaved pairs; the
  median ratio counts.
  The control is the same concurrent request without stop strings: a batch of two
  costs something by itself.
- The worker process's CPU time (all its threads, from /proc/<pid>/task/*/schedstat,
  in ns) to answer a 10 MB body, a 4 MB body of one huge prompt, and the 20,000
  stop strings.

`measure()` starts a demo worker unless given one (`base_url` and its `pid`); a
later `kvyard bench hardening` can call it and print the dict.
"""
from __future__ import annotations

import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

NORMAL = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
          "ignore_eos": True}


def _post(url: str, body: bytes, timeout: float = 600.0) -> tuple[int, bytes]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    except OSError as e:  # reset while sending: no answer
        return 0, str(e).encode()
    finally:
        conn.close()


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` so far."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that just ended
    return total


def _timed_normal(url: str) -> float:
    body = json.dumps(NORMAL).encode()
    t0 = time.perf_counter()
    status, raw = _post(url, body)
    if status != 200:
        raise RuntimeError(f"the normal request failed: {status} {raw[:200]!r}")
    return time.perf_counter() - t0


def stop_load(url: str, stops: list[str], pairs: int, loop: bool) -> dict[str, Any]:
    """Pairs of (alone, alongside stop-string requests): one sent with the normal
    request (the issue's case), or with `loop` sent back to back all through it."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True,
                       "stop": stops}).encode()
    statuses: list[int] = []
    alone, loaded = [], []
    for _ in range(pairs):
        alone.append(_timed_normal(url))
        done = threading.Event()

        def other() -> None:
            statuses.append(_post(url, body)[0])
            while loop and not done.is_set():
                statuses.append(_post(url, body)[0])
        t = threading.Thread(target=other, daemon=True)
        t.start()
        loaded.append(_timed_normal(url))
        done.set()
        t.join(600)
    ratios = [b / a for a, b in zip(alone, loaded)]
    return {"stops": len(stops), "stop_chars": len(stops[0]) if stops else 0,
            "body_bytes": len(body),
            "loop": loop, "stop_statuses": sorted(set(statuses)), "stop_requests": len(statuses),
            "alone_s": alone, "loaded_s": loaded, "ratios": ratios,
            "median_ratio": statistics.median(ratios)}


def reject_cpu(url: str, pid: int, body: bytes, runs: int) -> dict[str, Any]:
    """The worker's CPU time per answer to `body`, over the same wall time idle subtracted."""
    statuses, costs = [], []
    for _ in range(runs):
        c0, t0 = cpu_ns(pid), time.monotonic()
        statuses.append(_post(url, body)[0])
        time.sleep(0.2)  # the server may still be draining the body it refused
        busy, wall = cpu_ns(pid) - c0, time.monotonic() - t0
        c1 = cpu_ns(pid)
        time.sleep(wall)
        idle = cpu_ns(pid) - c1
        costs.append((busy - idle) / 1e6)
    return {"body_bytes": len(body), "statuses": sorted(set(statuses)), "cpu_ms": costs,
            "median_cpu_ms": statistics.median(costs)}


def measure(base_url: str | None = None, pid: int | None = None, *, pairs: int = 5,
            log_dir: Path | None = None) -> dict[str, Any]:
    """All of issue 15's worker numbers; starts a demo worker when none is given."""
    worker = None
    if base_url is None:
        from kvyard.bench import servers

        log = Path(log_dir or tempfile.mkdtemp(prefix="kvyard-limits-")) / "worker.log"
        worker = servers.worker(["--model", "demo", "--dtype", "float32"], log_path=log,
                                startup_timeout_s=300).start()
        base_url, pid = worker.base_url, worker.pid
    assert pid is not None, "give the worker's pid with its base_url"
    try:
        _timed_normal(base_url)  # warm: kernels, caches
        many = [f"stop string number {i:06d} of many, never in the text {i:06d}"
                for i in range(20_000)]
        cap = [f"{i:03d}" + "z" * 509 for i in range(128)]
        huge_prompt = b'{"prompt": "' + b"a " * (2_000_000 - 8) + b'"}'
        out: dict[str, Any] = {}
        # the control: the same concurrent request without stop strings (a batch of two)
        for name, stops in (("no_stops", []), ("stop_20000x55", many), ("stop_128x512", cap)):
            for loop in (False, True):
                out[name + ("_back_to_back" if loop else "")] = stop_load(base_url, stops,
                                                                          pairs, loop)
        out["reject_10MB_body"] = reject_cpu(base_url, pid, b'{"prompt": "' + b"a" * 10_000_000
                                             + b'"}', pairs)
        out["reject_4MB_prompt"] = reject_cpu(base_url, pid, huge_prompt, pairs)
        out["reject_20000_stops"] = reject_cpu(base_url, pid, json.dumps(
            {"prompt": "hi", "stop": many}).encode(), pairs)
        return out
    finally:
        if worker is not None:
            worker.stop()
