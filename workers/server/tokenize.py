"""vLLM's `/tokenize` and `/detokenize`."""
from __future__ import annotations

from aiohttp import web

from .body import parse_object, read_body
from .errors import ApiError
from .prompts import check_vocab, prompt_ids
from .protocol import parse_request, token_ids
from .state import get_state


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's `/tokenize`: the ids this server would prefill for a prompt or a chat.

    Lets clients (and tests) build token-id prompts without a tokenizer of their own."""
    state = get_state(request.app)
    body = parse_object(await read_body(request))
    kind = "chat" if "messages" in body else "completion"
    fields = {k: body[k] for k in ("model", "messages", "prompt") if k in body}
    req = parse_request(fields, kind, state.served_names, max_model_len=state.engine.max_model_len)
    prompts = await prompt_ids(state, req)
    if len(prompts) != 1:
        raise ApiError(400, "/tokenize takes one prompt", param="prompt", code="invalid_value")
    ids = prompts[0]
    return web.json_response({"tokens": ids, "count": len(ids),
                              "max_model_len": state.engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's `/detokenize`: {"tokens": [ids]} -> {"prompt": text}."""
    state = get_state(request.app)
    body = parse_object(await read_body(request))
    ids = token_ids(body.get("tokens"), "tokens")
    check_vocab(state, ids, "tokens")
    return web.json_response({"prompt": state.engine.tokenizer.decode(ids)})
