"""``POST /tokenize`` and ``POST /detokenize`` as vLLM serves them, answered by the router's own tokenizer and
chat template (the same ones it feeds the workers with), so no worker is asked.

/tokenize takes ``{"prompt": str, "add_special_tokens": true}`` or a chat (``messages``, ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``, ``tools``, ``add_special_tokens``: false) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; /detokenize takes ``{"tokens": [...]}`` and answers
``{"prompt": text}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..errors import bad_request, not_found
from .limits import read_body
from .protocol import parse_chat, parse_json

if TYPE_CHECKING:
    from ..app import Router


def _check_model(router: Router, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != router.config.served_model_name:
        raise not_found(f"The model `{model}` does not exist. This router serves "
                        f"`{router.config.served_model_name}` (see /v1/models).", "model", "model_not_found")
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be true or false, got {v!r}", name)
    return v


async def tokenize(router: Router, request: web.Request) -> web.Response:
    body = _check_model(router, parse_json(await read_body(request, router.config.max_body_bytes)))
    tok = router.tokenizer
    if "messages" in body:
        req = parse_chat(body)
        ids = await router._prompt_ids(req)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
        ids = tok.encode(prompt, _flag(body, "add_special_tokens", True))
    strs = list(tok.tok.convert_ids_to_tokens(ids)) if _flag(body, "return_token_strs", False) else None
    return web.json_response({"count": len(ids), "max_model_len": router.config.max_model_len, "tokens": ids,
                              "token_strs": strs})


async def detokenize(router: Router, request: web.Request) -> web.Response:
    body = _check_model(router, parse_json(await read_body(request, router.config.max_body_bytes)))
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise bad_request("'tokens' must be a list of non-negative integer token ids", "tokens")
    router.tokenizer.check_ids(ids, "tokens")
    return web.json_response({"prompt": router.tokenizer.decode(ids)})


def add_routes(app: web.Application, router: Router) -> None:
    app.router.add_post("/tokenize", lambda r: tokenize(router, r))
    app.router.add_post("/detokenize", lambda r: detokenize(router, r))
