"""Builds the ext_proc messages the EPP sends back to Envoy.

Routing = header mutation on the *headers* phase (set the destination,
remove any client copy of a routing header, clear the route cache so the
route with the destination-header match is selected) plus the same address in
`envoy.lb` dynamic metadata, which the ORIGINAL_DST cluster can also read.
"""
from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from kvyard.common.wire import (
    DESTINATION_HEADER, DESTINATION_METADATA_NAMESPACE, FLIGHT_HEADER, PREFILLER_AUTH_HEADER,
    PREFILLER_HEADER, ROUTING_HEADERS,
)

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def routing_response(destination: str, prefiller: str | None = None,
                     prefiller_auth: str | None = None,
                     flight: str | None = None) -> ep.ProcessingResponse:
    """Answer to the request-headers message that sends the request to `destination`
    (and, for P/D, names the prefill pod with the EPP's signature of it; for a request
    the SLO predictors time, its flight id for the gateway's observing filter)."""
    sets = [_set(DESTINATION_HEADER, destination)]
    removes = [h for h in ROUTING_HEADERS if h != DESTINATION_HEADER]
    if flight is not None:
        sets.append(_set(FLIGHT_HEADER, flight))
    else:
        removes.append(FLIGHT_HEADER)  # never a client's
    if prefiller:
        sets.append(_set(PREFILLER_HEADER, prefiller))
        removes.remove(PREFILLER_HEADER)
        if prefiller_auth:
            sets.append(_set(PREFILLER_AUTH_HEADER, prefiller_auth))
            removes.remove(PREFILLER_AUTH_HEADER)
    meta = struct_pb2.Struct()
    meta.fields[DESTINATION_METADATA_NAMESPACE].struct_value.fields[
        DESTINATION_HEADER].string_value = destination
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=sets, remove_headers=removes),
            clear_route_cache=True)),
        dynamic_metadata=meta)


def body_continue() -> ep.ProcessingResponse:
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse()))


def trailers_continue() -> ep.ProcessingResponse:
    return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())


def immediate(status: int, body: bytes, headers: tuple[tuple[str, str], ...] = (),
              details: str = "") -> ep.ProcessingResponse:
    """Envoy answers the client itself with this status/body; no upstream."""
    sets = [_set("content-type", "application/json")] + [_set(k, v) for k, v in headers]
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=ep.HeaderMutation(set_headers=sets), body=body, details=details))


def hold(seconds: float) -> ep.ProcessingResponse:
    """Tells Envoy to wait up to `seconds` for the real answer (flow control holds the
    request); Envoy caps it at the filter's max_message_timeout."""
    d = duration_pb2.Duration()
    d.FromMilliseconds(int(seconds * 1000))
    return ep.ProcessingResponse(override_message_timeout=d)
