"""One simulated pod: its HTTP app (the worker's routes, and the probes peers send) over
its engine, block pool and KV-event publisher.

Routes: POST /v1/completions and /v1/chat/completions (JSON or SSE, `usage`, stream
usage with `stream_options.include_usage`), GET /health, /metrics, /v1/models, and what
SGLang's router (smg 1.13) and vllm-router 0.1.17 probe, per the paths in their wheels:
/get_model_info, /get_server_info, /server_info, /get_load(s), /version, /ping,
/health_generate, /flush_cache (and vLLM's /reset_prefix_cache); `smg launch --policy
cache_aware` registers simulated pods and routes chat and streamed completions to them.
vLLM's /tokenize and /v1/completions/render: vllm-router 0.1.17 keys requests by their ids
and routes cache-blind without them; it asks every worker per request, so the process
renders each body once for all its pods (real pods would render in parallel).
Every answer carries
`x-kvyard-endpoint`. P/D: a decode pod given a signed `x-prefiller-host-port` asks
that prefill pod for the prefill (`max_tokens` 1, `kv_transfer_params.do_remote_decode`),
then pays the transfer time instead of the prefill (pd.py).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

from aiohttp import web

from kvyard.common import pd_auth, wire
from kvyard.common.hashing import adapter_seed
from kvyard.common.openai_shapes import DONE, Shaper, Usage
from kvyard.sim import metrics, startup
from kvyard.sim.engine import SimRequest
from kvyard.sim.pod import Pod
from kvyard.sim.requests import ApiError, GenerateSpec, parse_generate

POD: web.AppKey["Pod"] = web.AppKey("kvyard_sim_pod")
_ids = itertools.count(1)


def _error(pod: Pod, e: ApiError) -> web.Response:
    return web.Response(status=e.status, body=e.body(), content_type="application/json",
                        headers=pod.headers)


async def _wait(req: SimRequest) -> None:
    while not req.finished:
        await req.progress.wait()
        req.progress.clear()


def _kv_offer(pod: Pod, spec: GenerateSpec, req: SimRequest) -> dict | None:
    ktp = spec.raw.get(wire.KV_TRANSFER_PARAMS)
    if not (isinstance(ktp, dict) and ktp.get("do_remote_decode")):
        return None
    host, _, port = pod.address.rpartition(":")
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": pod.address,
            "remote_host": host, "remote_port": int(port or 0),
            "remote_block_ids": list(range(req.blocks.num_blocks)), "tp_size": 1}


async def _generate(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    chat = request.path.endswith("/chat/completions")
    try:
        spec = await parse_generate(await request.read(), chat, pod.tokenizer,
                                    pod.served + pod.adapters, pod.max_model_len)
        if -(-(len(spec.prompt_ids) + 1) // pod.engine.pool.block_size) > pod.engine.pool.capacity:
            raise ApiError(400, f"the prompt ({len(spec.prompt_ids)} tokens) does not fit this "
                           f"pod's KV cache ({pod.engine.pool.capacity} blocks)",
                           "context_length_exceeded", "prompt")
        remote = await _prefill_elsewhere(request, pod, spec)
    except ApiError as e:
        return _error(pod, e)
    adapter = spec.model if spec.model in pod.adapters else None
    # `sim_output_tokens` (simulator only): the answer's natural length, as an EOS would
    # end it before max_tokens (benchmarks of output-length prediction need one).
    natural = spec.raw.get("sim_output_tokens")
    if type(natural) is int and 0 < natural < spec.max_tokens:
        spec.max_tokens = natural
    req = SimRequest(f"{'chatcmpl' if chat else 'cmpl'}-sim-{next(_ids)}", spec.prompt_ids,
                     spec.max_tokens, remote_prefill=remote, adapter=adapter)
    if adapter is not None:  # an adapter's KV is its own (vLLM keys blocks by LoRA)
        req.blocks.seed, req.blocks.lora_name = adapter_seed(adapter), adapter
    pod.engine.submit(req)
    shaper = Shaper("chat" if chat else "completion", req.rid, spec.model)
    try:
        if spec.stream:
            return await _stream(request, pod, req, shaper, spec.include_usage)
        await _wait(req)
        body = shaper.final([(pod.text(req.output_ids), req.finish_reason, None)], _usage(req))
        offer = _kv_offer(pod, spec, req)
        if offer is not None:
            body[wire.KV_TRANSFER_PARAMS] = offer
        return web.json_response(body, headers=pod.headers)
    finally:
        pod.engine.abort(req)  # a client gone mid-way (no-op once finished)


def _usage(req: SimRequest) -> Usage:
    return Usage(len(req.prompt_ids), len(req.output_ids), req.cached_tokens)


async def _stream(request: web.Request, pod: Pod, req: SimRequest, shaper: Shaper,
                  include_usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={**pod.headers, "Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        if shaper.kind == "chat":
            await resp.write(shaper.chunk("", role=True, with_usage_field=include_usage))
        sent = 0
        while True:
            await req.progress.wait()
            req.progress.clear()
            new = req.output_ids[sent:]
            if new:
                sent += len(new)
                await resp.write(shaper.chunk(pod.text(new), with_usage_field=include_usage))
            if req.finished:
                break
        await resp.write(shaper.chunk(None, req.finish_reason, with_usage_field=include_usage))
        if include_usage:
            await resp.write(shaper.usage_chunk(_usage(req)))
        await resp.write(DONE)
        await resp.write_eof()
    except ConnectionResetError:
        pass
    return resp


async def _prefill_elsewhere(request: web.Request, pod: Pod, spec: GenerateSpec) -> bool:
    """P/D decode side: True once the chosen prefill pod has prefilled this prompt."""
    target = request.headers.get(wire.PREFILLER_HEADER)
    if not target or pod.role == "prefill":
        return False
    why = pd_auth.verify(pod.pd_key, target, request.headers.get(wire.PREFILLER_AUTH_HEADER))
    if why is not None:
        pod.rejected += 1
        raise ApiError(403, f"prefill target refused: {why}", "prefill_target_refused",
                       wire.PREFILLER_HEADER)
    from kvyard.sim.pd import remote_prefill

    ok = await remote_prefill(pod, target, spec.prompt_ids)
    if ok:
        pod.handoffs += 1
    else:
        pod.fallbacks += 1
    return ok


async def _health(request: web.Request) -> web.Response:
    pod = request.app[POD]
    return web.json_response({"status": "ok", "role": pod.role, "sleeping": False,
                              "simulated": True}, headers=pod.headers)


async def _metrics(request: web.Request) -> web.Response:
    pod = request.app[POD]
    return web.Response(body=metrics.render(pod), content_type="text/plain",
                        headers=pod.headers)


async def _models(request: web.Request) -> web.Response:
    pod = request.app[POD]
    created = int(pod.started)
    return web.json_response({"object": "list", "data": [
        {"id": n, "object": "model", "created": created, "owned_by": "kvyard-sim",
         "root": pod.served[0], "parent": None, "max_model_len": pod.max_model_len}
        for n in pod.served] + [
        {"id": n, "object": "model", "created": created, "owned_by": "kvyard-sim",
         "root": path, "parent": pod.served[0], "max_model_len": pod.max_model_len}
        for n, path in (pod.engine.lora.modules.items() if pod.engine.lora else ())]},
        headers=pod.headers)


async def _model_info(request: web.Request) -> web.Response:
    """SGLang's /get_model_info (what its router reads at registration)."""
    pod = request.app[POD]
    return web.json_response({"model_path": pod.served[0], "tokenizer_path": pod.served[0],
                              "is_generation": True, "preferred_sampling_params": None,
                              "weight_version": "default", "has_image_understanding": False,
                              "has_audio_understanding": False, "model_type": "llama",
                              "architectures": ["LlamaForCausalLM"]}, headers=pod.headers)


async def _server_info(request: web.Request) -> web.Response:
    """SGLang's /get_server_info: the server args its router reads, and the load."""
    pod = request.app[POD]
    e = pod.engine
    mode = {"prefill": "prefill", "decode": "decode"}.get(pod.role, "null")
    return web.json_response({
        "model_path": pod.served[0], "served_model_name": pod.served[0],
        "page_size": e.pool.block_size, "max_running_requests": e.max_num_seqs,
        "context_length": pod.max_model_len, "disaggregation_mode": mode,
        "max_total_num_tokens": e.pool.capacity * e.pool.block_size,
        "tp_size": 1, "dp_size": 1, "version": "kvyard-sim",
        "internal_states": [{"load": len(e.running) + len(e.waiting)}]}, headers=pod.headers)


async def _load(request: web.Request) -> web.Response:
    """SGLang's /get_load: one entry per data-parallel rank."""
    pod = request.app[POD]
    e = pod.engine
    used = int(e.pool.usage * e.pool.capacity * e.pool.block_size)
    return web.json_response([{"dp_rank": 0, "num_reqs": len(e.running) + len(e.waiting),
                               "num_waiting_reqs": len(e.waiting), "num_tokens": used}],
                             headers=pod.headers)


async def _ok(request: web.Request) -> web.Response:
    """/ping and /health_generate: alive (a simulated pod has no model to fail)."""
    return web.Response(text="ok", headers=request.app[POD].headers)


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": "kvyard-sim"}, headers=request.app[POD].headers)


async def _flush(request: web.Request) -> web.Response:
    """SGLang's /flush_cache, vLLM's /reset_prefix_cache: unreferenced cached blocks go
    (AllBlocksCleared on the KV-event stream)."""
    pod = request.app[POD]
    pod.engine.pool.clear()
    pod.engine.flush_events()
    return web.Response(text="ok", headers=pod.headers)


# The last bodies rendered, shared by the process's pods: vllm-router asks every worker to
# render each request, which real pods do in parallel on their own CPUs; here the N asks of
# one body cost one tokenization, not N on this one process.
_RENDERED: OrderedDict[bytes, list[int]] = OrderedDict()
_RENDERED_MAX = 256


async def _prompt_ids(request: web.Request) -> list[int] | web.Response:
    """The ids a generate request with this body would prefill (chat when it has messages)."""
    pod = request.app[POD]
    data = await request.read()
    ids = _RENDERED.get(data)
    if ids is not None:
        _RENDERED.move_to_end(data)
        return ids
    try:
        chat = request.path.startswith("/v1/chat/") or b'"messages"' in data
        spec = await parse_generate(data, chat, pod.tokenizer, pod.served, pod.max_model_len)
    except ApiError as e:
        return _error(pod, e)
    _RENDERED[data] = spec.prompt_ids
    if len(_RENDERED) > _RENDERED_MAX:
        _RENDERED.popitem(last=False)
    return spec.prompt_ids


async def _tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize (as `kvyard worker` answers it)."""
    ids = await _prompt_ids(request)
    if isinstance(ids, web.Response):
        return ids
    pod = request.app[POD]
    return web.json_response({"tokens": ids, "count": len(ids),
                              "max_model_len": pod.max_model_len}, headers=pod.headers)


async def _render(request: web.Request) -> web.Response:
    """vLLM's /v1/completions/render: the engine prompts, not generated. vllm-router's
    cache_aware and kv_aware key requests by these ids (or /tokenize's) and route
    cache-blind without either."""
    ids = await _prompt_ids(request)
    if isinstance(ids, web.Response):
        return ids
    # One entry per prompt with the ids as `token_ids`: vllm-router 0.1.17 rejects an
    # entry keyed `prompt_token_ids` (invalid_token_ids) and falls back to the text.
    return web.json_response([{"token_ids": ids}], headers=request.app[POD].headers)


def make_app(pod: Pod) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024,
                          middlewares=[startup.gate(lambda r: r.app[POD])])
    app[POD] = pod
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/get_model_info", _model_info)
    app.router.add_get("/get_server_info", _server_info)
    app.router.add_get("/get_load", _load)
    app.router.add_get("/get_loads", _load)
    app.router.add_get("/server_info", _server_info)
    app.router.add_get("/version", _version)
    app.router.add_get("/ping", _ok)
    app.router.add_get("/health_generate", _ok)
    for path in ("/flush_cache", "/reset_prefix_cache"):
        app.router.add_post(path, _flush)
    app.router.add_get("/flush_cache", _flush)
    app.router.add_post("/v1/completions", _generate)
    app.router.add_post("/v1/chat/completions", _generate)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/v1/completions/render", _render)
    return app
