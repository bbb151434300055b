"""The ext_proc stream handler: one bidirectional stream per HTTP request.

Body handling (pinned with the gateway's Envoy config, kvyard/gateway/config.py):
request headers SEND; request body STREAMED with
`send_body_without_waiting_for_header_response`, behind Envoy's buffer
filter; response headers SKIP, response body NONE. The buffer filter holds
the whole body (and answers 413 over the limit), so we receive it as one
chunk with end_of_stream right after the headers. Why not BUFFERED: Envoy
then sends no body until the headers message is answered, and we can only
answer it once we have read the prompt (a deadlock, checked with Envoy 1.40).
Why not FULL_DUPLEX_STREAMED like the reference EPP: routing needs the whole
body anyway; one chunk means nothing to replay on the way back and one
message per request, and FailOpen keeps working. We still check
`--max-body-bytes` ourselves and accept bodies split into several chunks.

Order on the stream: request_headers arrives first and is held (unless it
has end_of_stream, e.g. GET /v1/models, which is routed at once); when the
body arrives we decide, then answer the headers message with the routing
mutation and the body message with an empty "continue". A request flow
control holds (`flow_control.py`) first gets an `override_message_timeout`
answer, which tells Envoy to wait past its per-message timeout (up to the
gateway's max_message_timeout); a client that goes away meanwhile cancels
this stream, and with it the request's place in the queue. Every failure,
including our own bugs, becomes an ImmediateResponse: Envoy is never left
waiting on the stream. A stream that breaks that order (a body or a second
headers message before the request's headers were answered, which Envoy never
sends) is a protocol error: it ends with gRPC INVALID_ARGUMENT, never with a
routing decision made on half a request.
"""
from __future__ import annotations

import logging

import grpc
import time
from dataclasses import dataclass
from typing import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvyard.common import pd_auth
from kvyard.common.wire import MAX_HOLD_S

from . import responses
from .flow.controller import FlowController
from .observability import EppMetrics
from .request import RequestError
from .router import Finisher, Router
from .scheduling.scheduler import Decision

log = logging.getLogger("kvyard.epp")
HOLD_MARGIN_S = 5.0  # Envoy waits this much past a held request's TTL for our answer


def _headers(msg: ep.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


@dataclass(slots=True)
class ExtProcServicer(ep_grpc.ExternalProcessorServicer):
    router: Router
    metrics: EppMetrics
    finisher: Finisher
    max_body_bytes: int = 4 * 1024 * 1024
    pd_key: bytes | None = None  # signs x-prefiller-host-port (kvyard.common.pd_auth)
    flow: FlowController | None = None  # None: nothing is held (429/503 at once)

    def _routing(self, d: Decision, has_body: bool) -> list[ep.ProcessingResponse]:
        pre = d.prefill.address if d.prefill is not None else None
        auth = pd_auth.sign(self.pd_key, pre) if pre and self.pd_key else None
        out = [responses.routing_response(d.destination, pre, auth)]
        if has_body:
            out.append(responses.body_continue())
        return out

    def _refuse(self, e: RequestError) -> ep.ProcessingResponse:
        self.metrics.error(e.reason)
        return responses.immediate(e.status, e.body(), e.headers, e.reason)

    def _decide(self, headers: dict[str, str],
                body: bytes | None) -> tuple[list[ep.ProcessingResponse], Decision | None]:
        """Headers answer (routing or immediate) and, for a body, its continue; never holds."""
        t0 = time.perf_counter()
        try:
            d = self.router.route(headers, body)
        except RequestError as e:
            return [self._refuse(e)], None
        self.metrics.decision(time.perf_counter() - t0, d)
        return self._routing(d, body is not None), d

    async def _answer(self, headers: dict[str, str] | None,
                      chunks: list[bytes]) -> AsyncIterator[ep.ProcessingResponse]:
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        headers = headers or {}
        await self.finisher.settle()
        if self.flow is None:
            answers, decision = self._decide(headers, body)
        else:
            t0 = time.perf_counter()
            try:
                req = self.router.prepare(headers, body)
                d = self.flow.try_now(req)
                if isinstance(d, str):  # held: tell Envoy to wait, then wait our turn
                    w = self.flow.enqueue(req, d, len(body), headers)
                    yield responses.hold(min(self.flow.remaining_s(w) + HOLD_MARGIN_S,
                                             MAX_HOLD_S))
                    t0 = time.perf_counter()
                    d = await self.flow.wait(w)
            except RequestError as e:
                yield self._refuse(e)
                return
            self.metrics.decision(time.perf_counter() - t0, d)
            answers, decision = self._routing(d, True), d
        if decision is not None:
            # Registered before Envoy gets the answer (the hashing itself runs
            # in the finisher's thread): code after the last `yield` only runs
            # when gRPC resumes this generator, and under load the client's
            # next request could be decided first, before `settle` knew there
            # was teaching to wait for — which broke prefix stickiness.
            self.finisher.submit(decision)
        for r in answers:
            yield r

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context) -> AsyncIterator[ep.ProcessingResponse]:
        headers: dict[str, str] | None = None
        chunks: list[bytes] = []
        size = 0
        decided = False
        async for msg in request_iterator:
            kind = msg.WhichOneof("request")
            if (kind == "request_headers" and headers is not None) or (
                    kind in ("request_body", "request_trailers") and headers is None):
                self.metrics.error("protocol")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"ext_proc: {kind} out of order (request headers come "
                                    "first, once)")
            try:
                if kind == "request_headers":
                    headers = _headers(msg.request_headers)
                    if msg.request_headers.end_of_stream:
                        decided = True
                        for r in self._decide(headers, None)[0]:
                            yield r
                elif kind == "request_body":
                    size += len(msg.request_body.body)
                    if size > self.max_body_bytes:
                        self.metrics.error("body_too_large")
                        err = RequestError(413, f"request body exceeds {self.max_body_bytes} bytes",
                                           "body_too_large", code="request_too_large")
                        yield responses.immediate(413, err.body(), details=err.reason)
                        return
                    chunks.append(msg.request_body.body)
                    if msg.request_body.end_of_stream:
                        decided = True
                        async for r in self._answer(headers, chunks):
                            yield r
                elif kind == "request_trailers":
                    if not decided:  # trailers, not the body, ended the request
                        decided = True
                        async for r in self._answer(headers, chunks):
                            yield r
                    yield responses.trailers_continue()
                elif kind == "response_headers":
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
                elif kind == "response_body":
                    yield ep.ProcessingResponse(response_body=ep.BodyResponse())
                elif kind == "response_trailers":
                    yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
            except Exception:  # noqa: BLE001 - answer 500, keep serving
                log.exception("ext_proc: internal error")
                self.metrics.error("internal")
                err = RequestError(500, "internal error in the endpoint picker", "internal")
                yield responses.immediate(500, err.body(), details="internal")
                return
