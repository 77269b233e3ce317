"""``POST /v1/responses``: the OpenAI Responses API (stateless) through P and D, as vLLM 0.32 serves it.

The request becomes a chat-completion body (:mod:`..api.responses_request`), which runs on the router's chat path
(:mod:`.chat_bridge`); the answer is written in the Responses API's shapes (:mod:`..api.responses_shape`), streamed or
not. Errors are OpenAI-shaped, as vLLM's /v1/responses answers them; a context-length error names
``max_output_tokens`` or ``input`` (the chat path says ``max_tokens`` or ``messages``).
"""

from __future__ import annotations

from aiohttp import web

from ..api.limits import read_body
from ..api.protocol import parse_json
from ..api.response import dumps
from ..api.responses_request import to_chat
from ..api.responses_shape import ResponseEvents, ResponseShape, output_items, status_of, usage
from ..errors import RouterError
from .chat_bridge import ChatBridge
from .context import RouterContext

# the chat path's names for this endpoint's fields (a context-length error names the prompt or the output budget)
_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input"}


class ResponsesEndpoint:
    """The /v1/responses handler over the router's chat path."""

    def __init__(self, bridge: ChatBridge) -> None:
        self.bridge = bridge

    async def handle(self, request: web.Request) -> web.StreamResponse:
        b = self.bridge
        try:
            async with b.admitted("responses") as visit:
                body = parse_json(await read_body(request, b.max_body_bytes))
                chat = to_chat(body)
                run = await b.start(request, chat, visit)
                shape = ResponseShape(body, b.answer_name(run), run.max_tokens)
                if chat["stream"]:
                    resp, visit.status = await b.stream(request, run, ResponseEvents(shape, run.prompt_tokens))
                    visit.done = True
                    return resp
                r = await run.result()
                out = shape.response(output_items(r.message, bool(chat.get("tools")), r.logprobs),
                                     status_of(r.finish_reason), usage(r.prompt_tokens, r.completion_tokens))
                visit.done = True
                return web.Response(text=dumps(out), content_type="application/json")
        except RouterError as e:
            e.param = _PARAMS.get(e.param or "", e.param)
            return web.json_response(e.to_dict(), status=e.status, headers=e.headers)


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    app.router.add_post("/v1/responses", ResponsesEndpoint(ChatBridge(ctx.intake)).handle)
