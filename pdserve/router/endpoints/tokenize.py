"""``POST /tokenize`` and ``POST /detokenize`` as vLLM serves them, answered by the router's own tokenizer and
chat template (the same ones it feeds the workers with), so no worker is asked.

/tokenize takes ``{"prompt": str, "add_special_tokens": true}`` or a chat (``messages``, ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``, ``tools``, ``add_special_tokens``: false) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; /detokenize takes ``{"tokens": [...]}`` and answers
``{"prompt": text}``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..api.fields import TOKENIZE_CHAT_FIELDS, refuse_nulls
from ..api.lax_values import flag
from ..api.limits import read_body
from ..api.model_catalog import ModelCatalog
from ..api.protocol import GenerationRequest, parse_chat, parse_json, token_id_list
from ..api.tokenizer import PromptTokenizer
from ..errors import bad_request
from .context import RouterContext

PromptIds = Callable[[GenerationRequest], Awaitable[list[int]]]



@dataclass(frozen=True)
class TokenizeApi:
    """The two endpoints, given what they need from the router: its tokenizer, the function that renders and
    tokenizes a chat exactly as a generation request's prompt is (``prompt_ids``), the served model and its LoRA
    adapters (an adapter tokenizes as its base model, as on vLLM), the context length and the body limit."""

    tokenizer: PromptTokenizer
    prompt_ids: PromptIds
    models: ModelCatalog
    max_model_len: int
    max_body_bytes: int

    def check_model(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        self.models.adapter(body.get("model"))  # 404 for an unknown model
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        body = self.check_model(parse_json(await read_body(request, self.max_body_bytes)))
        tok = self.tokenizer
        if "messages" in body:
            ids = await self.prompt_ids(parse_chat({k: v for k, v in body.items() if k in TOKENIZE_CHAT_FIELDS}))
        else:
            refuse_nulls(body, frozenset({"add_special_tokens"}))  # as vLLM's TokenizeCompletionRequest
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
            ids = tok.encode(prompt, flag(body, "add_special_tokens", True))
        strs = list(tok.tok.convert_ids_to_tokens(ids)) if flag(body, "return_token_strs", False) else None
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                                  "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = self.check_model(parse_json(await read_body(request, self.max_body_bytes)))
        ids = token_id_list(body.get("tokens"), "tokens")
        self.tokenizer.check_ids(ids, "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(ids)})


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    """POST /tokenize and /detokenize on ``app``: a chat is rendered and tokenized as the front door does."""
    api = TokenizeApi(ctx.tokenizer, ctx.intake.prompt_ids, ctx.models, ctx.config.max_model_len,
                      ctx.config.max_body_bytes)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)
