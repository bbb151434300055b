"""The ext_proc stream handler: one bidirectional stream per HTTP request.

Only the protocol lives here (stream order, Envoy's messages, timeouts); what
happens to the request is the director's (`director.py`).

Body handling (pinned with the gateway's Envoy config, kvyard/gateway/config.py):
request headers SEND; request body STREAMED with
`send_body_without_waiting_for_header_response`, behind Envoy's buffer
filter; response headers SKIP, response body NONE (the SLO predictors' timing comes
on streams of the gateway's second, observe-only filter: `_observe`). The buffer filter holds
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
control holds (`flow/controller.py`) first gets an `override_message_timeout`
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
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvyard.common import pd_auth
from kvyard.common.wire import MAX_HOLD_S, OBSERVE_METADATA

from . import responses
from .admission import Held
from .director import Director
from .request import Rejection, body_too_large, internal
from .scheduling.types import Decision
from .slo.observe import Observer

log = logging.getLogger("kvyard.epp")
HOLD_MARGIN_S = 5.0  # Envoy waits this much past a held request's TTL for our answer


def _headers(msg: ep.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


@dataclass(slots=True)
class ExtProcServicer(ep_grpc.ExternalProcessorServicer):
    director: Director
    max_body_bytes: int = 4 * 1024 * 1024
    pd_key: bytes | None = None  # signs x-prefiller-host-port (kvyard.common.pd_auth)
    # With a latency scorer (epp/slo/): the requests its predictor follows are named in the
    # routing answer, and the gateway's observing filter streams their responses here.
    observer: Observer | None = None

    def _routing(self, d: Decision, has_body: bool) -> list[ep.ProcessingResponse]:
        pre = d.prefill.address if d.prefill is not None else None
        auth = pd_auth.sign(self.pd_key, pre) if pre and self.pd_key else None
        flight = self.observer.watch(d.prompt) if self.observer is not None else None
        out = [responses.routing_response(d.destination, pre, auth, flight)]
        if has_body:
            out.append(responses.body_continue())
        return out

    def _error(self, e: Rejection) -> ep.ProcessingResponse:
        """One the server finds itself (the director counts its own rejections)."""
        self.director.metrics.error(e.reason)
        return _refusal(e)

    async def _answer(self, headers: dict[str, str] | None,
                      body: bytes | None) -> AsyncIterator[ep.ProcessingResponse]:
        """The answer to the request's headers (routing or immediate) and, for a body,
        its continue; a held request first gets Envoy's hold (`override_message_timeout`)."""
        if body is not None:
            await self.director.settle()
        out = self.director.handle(headers or {}, body)
        if type(out) is Held:
            yield responses.hold(min(out.remaining_s + HOLD_MARGIN_S, MAX_HOLD_S))
            out = await self.director.wait(out)
        if type(out) is not Decision:
            yield _refusal(out)
            return
        if body is not None:
            # Registered before Envoy gets the answer (the hashing itself runs
            # in the finisher's thread): code after the last `yield` only runs
            # when gRPC resumes this generator, and under load the client's
            # next request could be decided first, before `settle` knew there
            # was teaching to wait for — which broke prefix stickiness.
            self.director.finish(out)
        for r in self._routing(out, body is not None):
            yield r

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context) -> AsyncIterator[ep.ProcessingResponse]:
        if self.observer is not None and _observing(context):
            await self.observer.stream(request_iterator, _headers)
            return  # observability mode: Envoy reads no answers
        headers: dict[str, str] | None = None
        chunks: list[bytes] = []
        size = 0
        decided = False
        async for msg in request_iterator:
            kind = msg.WhichOneof("request")
            if (kind == "request_headers" and headers is not None) or (
                    kind in ("request_body", "request_trailers") and headers is None):
                self.director.metrics.error("protocol")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"ext_proc: {kind} out of order (request headers come "
                                    "first, once)")
            try:
                if kind == "request_headers":
                    headers = _headers(msg.request_headers)
                    if msg.request_headers.end_of_stream:
                        decided = True
                        async for r in self._answer(headers, None):
                            yield r
                elif kind == "request_body":
                    size += len(msg.request_body.body)
                    if size > self.max_body_bytes:
                        yield self._error(body_too_large(self.max_body_bytes))
                        return
                    chunks.append(msg.request_body.body)
                    if msg.request_body.end_of_stream:
                        decided = True
                        async for r in self._answer(headers, _joined(chunks)):
                            yield r
                elif kind == "request_trailers":
                    if not decided:  # trailers, not the body, ended the request
                        decided = True
                        async for r in self._answer(headers, _joined(chunks)):
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
                yield self._error(internal())
                return


def _observing(context) -> bool:
    """A stream of the gateway's observe-only filter (it sends OBSERVE_METADATA)."""
    return any(k == OBSERVE_METADATA for k, _ in (context.invocation_metadata() or ()))


def _joined(chunks: list[bytes]) -> bytes:
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _refusal(e: Rejection) -> ep.ProcessingResponse:
    return responses.immediate(e.status, e.body(), e.headers, e.reason)
