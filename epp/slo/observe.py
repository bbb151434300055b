"""One response's timing, from the ext_proc response messages of an observed request.

SSE bodies: the first chunk with generated text (a non-empty `"text"` or `"content"`
string) is the first token; each such event counts toward TPOT; the end of the body is
the end; `usage.completion_tokens`, when the client asked for usage, is the output
length (else the events). A JSON (non-streamed) answer has no observable first token:
only its output length is learned. An error status, or a stream that ends without an
end of body, releases the request's load and teaches nothing.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from kvyard.common.wire import FLIGHT_HEADER

from .predictor import Flight, LatencyPredictor

_TEXT = re.compile(rb'"(?:text|content)":\s?"(?:[^"\\]|\\.)')
_USAGE = re.compile(rb'"completion_tokens":\s?(\d+)')


@dataclass(slots=True)
class ResponseTracker:
    predictor: LatencyPredictor
    flight: Flight
    events: int = 0
    tokens: int | None = None
    streamed: bool = True
    failed: bool = False
    done: bool = False

    def headers(self, headers: dict[str, str]) -> None:
        status = headers.get(":status", "200")
        self.failed = not status.startswith("2")
        self.streamed = headers.get("content-type", "").startswith("text/event-stream")

    def body(self, chunk: bytes, end: bool, t: float | None = None) -> None:
        if self.done:
            return
        t = time.monotonic() if t is None else t
        if not self.failed:
            n = len(_TEXT.findall(chunk))
            if n and self.events == 0 and self.streamed:
                self.predictor.first_token(self.flight, t)
            self.events += n
            m = _USAGE.search(chunk)
            if m is not None:
                self.tokens = int(m.group(1))
        if end:
            self._end(t)

    def _end(self, t: float) -> None:
        self.done = True
        f, p = self.flight, self.predictor
        if self.failed:
            p.abandon(f)
        elif self.streamed:
            p.finish(f, t, self.events, self.tokens)
        else:
            out = self.tokens if self.tokens is not None else 0
            if out > 0:
                fa = f.facts
                p.outlen.observe(fa.model, fa.fairness_id, fa.max_tokens, fa.predicted_output,
                                 out)
            p.abandon(f)

    def close(self) -> None:
        """The ext_proc stream ended; without an end of body nothing is learned."""
        if not self.done:
            self.done = True
            self.predictor.abandon(self.flight)


@dataclass(slots=True)
class Observer:
    """Pairs routed requests with the gateway's observing ext_proc streams: `watch` gives a
    decision's flight an id (sent in FLIGHT_HEADER), `stream` reads that request's
    response messages into its `ResponseTracker`. Ids of streams that never come (a
    gateway without the observing filter) are dropped oldest first."""

    predictor: LatencyPredictor
    max_watching: int = 8192
    watching: dict[str, ResponseTracker] = field(default_factory=dict)
    serial: int = 0

    def watch(self, prompt) -> str | None:
        f = self.predictor.claim(prompt)
        if f is None:
            return None
        self.serial += 1
        fid = str(self.serial)
        if len(self.watching) >= self.max_watching:
            self.watching.pop(next(iter(self.watching))).close()
        self.watching[fid] = ResponseTracker(self.predictor, f)
        return fid

    async def stream(self, messages: AsyncIterator, headers_of: Callable[[Any], dict]) -> None:
        """One observing stream: the request's headers (its flight id), then its response."""
        tracker: ResponseTracker | None = None
        try:
            async for msg in messages:
                kind = msg.WhichOneof("request")
                if kind == "request_headers":
                    fid = headers_of(msg.request_headers).get(FLIGHT_HEADER)
                    tracker = self.watching.pop(fid, None) if fid else None
                elif tracker is None:
                    continue
                elif kind == "response_headers":
                    tracker.headers(headers_of(msg.response_headers))
                    if msg.response_headers.end_of_stream:
                        tracker.body(b"", True)
                elif kind == "response_body":
                    tracker.body(msg.response_body.body, msg.response_body.end_of_stream)
        finally:
            if tracker is not None:
                tracker.close()
