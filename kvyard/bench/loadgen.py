"""A closed-loop HTTP load generator that is cheap enough not to be the bottleneck.

It keeps `concurrency` keep-alive connections busy with the same chat request
for a fixed duration and counts completions. It speaks HTTP/1.1 over raw
asyncio streams (no client library: per request it writes prebuilt bytes and
parses one status line and a Content-Length), which costs a fraction of an
aiohttp client's CPU. `kvyard bench epp` runs it in its own process, so the
client never shares an interpreter with what it measures, and gives both
paths the same generator, concurrency and duration.

Run: `python -m kvyard.bench.loadgen --url http://127.0.0.1:8080 --duration 5`
(prints one JSON object).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from kvyard.bench.report import percentile
from kvyard.common.models import DEMO_SERVED_NAME


@dataclass(slots=True)
class LoadResult:
    requests: int = 0
    errors: int = 0
    # Everything answered, warm-up included: the divisor for CPU-per-request.
    total_answered: int = 0
    seconds: float = 0.0
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0  # the generator's own CPU time, so callers can see what it cost


def build_request(host: str, port: int, prompt_chars: int, model: str) -> bytes:
    """One chat request; every request is identical so the client does no work per request."""
    words = ("the quick brown fox jumps over the lazy dog " * (prompt_chars // 44 + 1))[:prompt_chars]
    body = json.dumps({"model": model, "max_tokens": 4,
                       "messages": [{"role": "user", "content": words}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = None
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        lname = name.strip().lower()
        if lname == b"content-length":
            length = int(value)
        elif lname == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if length is not None:
        await reader.readexactly(length)
    elif chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return status


async def _worker(host: str, port: int, req: bytes, stop_at: float, measure_from: float,
                  lat: list[float], res: LoadResult) -> None:
    reader = writer = None
    while time.monotonic() < stop_at:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            t0 = time.monotonic()
            writer.write(req)
            status = await _read_response(reader)
            t1 = time.monotonic()
        except (OSError, asyncio.IncompleteReadError, ValueError):
            res.errors += 1
            if writer is not None:
                writer.close()
            reader = writer = None
            continue
        res.total_answered += 1
        if t0 >= measure_from:
            res.statuses[str(status)] = res.statuses.get(str(status), 0) + 1
            if status == 200:
                res.requests += 1
                lat.append(t1 - t0)
            else:
                res.errors += 1
    if writer is not None:
        writer.close()


async def run_load(url: str, concurrency: int, duration_s: float, warmup_s: float = 0.5,
                   prompt_chars: int = 2000, model: str = DEMO_SERVED_NAME) -> LoadResult:
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    req = build_request(host, port, prompt_chars, model)
    start = time.monotonic()
    measure_from = start + warmup_s
    stop_at = measure_from + duration_s
    lat: list[float] = []
    res = LoadResult()
    await asyncio.gather(*(_worker(host, port, req, stop_at, measure_from, lat, res)
                           for _ in range(concurrency)))
    res.seconds = max(1e-9, time.monotonic() - measure_from)
    res.rps = res.requests / res.seconds
    if lat:
        res.p50_ms = 1000 * percentile(lat, 50)
        res.p99_ms = 1000 * percentile(lat, 99)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--prompt-chars", type=int, default=2000)
    p.add_argument("--model", default=DEMO_SERVED_NAME, help="the model name in each request")
    a = p.parse_args(argv)
    res = asyncio.run(run_load(a.url, a.concurrency, a.duration, a.warmup, a.prompt_chars, a.model))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    res.cpu_s = ru.ru_utime + ru.ru_stime
    print(json.dumps(asdict(res)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
