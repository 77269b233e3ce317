"""``POST /v1/messages``: the Anthropic Messages API through P and D, as vLLM 0.32 serves it.

The request becomes a chat-completion body (:mod:`..api.messages_request`), which runs on the router's chat path
(:mod:`.chat_bridge`); the answer is written in the Messages API's shapes (:mod:`..api.messages_stream`), streamed or
not. Every error is in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with the router's
status (400 naming the field, 404 for an unknown model, 413, 429, 502, 504): before the first event as the HTTP
answer, after it as an ``error`` event.
"""

from __future__ import annotations

from aiohttp import web

from ..api.limits import read_body
from ..api.messages_request import EFFORTS, to_chat
from ..api.messages_stream import MessageEvents, error_body, message_body
from ..api.protocol import parse_json
from ..api.response import dumps
from ..api.tokenizer import PromptTokenizer
from ..errors import RouterError
from .chat_bridge import ChatBridge
from .context import RouterContext

# vLLM's probe of a chat template: does it take a system message after the first turn?
_PROBE = [{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
          {"role": "system", "content": "t"}, {"role": "user", "content": "t"}]


class MessagesEndpoint:
    """The /v1/messages handler over the router's chat path."""

    def __init__(self, bridge: ChatBridge, tokenizer: PromptTokenizer) -> None:
        self.bridge = bridge
        self.tokenizer = tokenizer
        self._merge: bool | None = None
        self._effort: str | None = None

    def disabled_effort(self) -> str:
        """The reasoning effort ``thinking: disabled`` sends: "none", or "low" when the chat template fails on
        "none" or renders it as some effort (it cannot turn thinking off). Probed once, as vLLM probes."""
        if self._effort is None:
            prompts = [self._render(e) for e in ("none", *EFFORTS)]
            self._effort = "low" if prompts[0] is None or prompts[0] in prompts[1:] else "none"
        return self._effort

    def _render(self, effort: str) -> str | None:
        try:
            return self.tokenizer.render_chat([{"role": "user", "content": "Hi"}], reasoning_effort=effort,
                                              enable_thinking=effort != "none")
        except RouterError:
            return None

    def merge_inline_system(self) -> bool:
        """True when the chat template rejects a system message after the first turn (probed once)."""
        if self._merge is None:
            try:
                self.tokenizer.render_chat(_PROBE, False)
                self._merge = False
            except RouterError:
                self._merge = True
        return self._merge

    async def handle(self, request: web.Request) -> web.StreamResponse:
        b = self.bridge
        try:
            async with b.admitted("messages") as visit:
                body = parse_json(await read_body(request, b.max_body_bytes))
                disabled = isinstance(body, dict) and isinstance(body.get("thinking"), dict) \
                    and body["thinking"].get("type") == "disabled"
                chat = to_chat(body, self.merge_inline_system(), self.disabled_effort() if disabled else "none")
                run = await b.start(request, chat, visit)
                if chat["stream"]:
                    resp, visit.status = await b.stream(request, run, MessageEvents(
                        run.request_id, b.answer_name(run), run.prompt_tokens))
                    visit.done = True
                    return resp
                r = await run.result()
                body = message_body(run.request_id, b.answer_name(run), r.message, r.finish_reason, r.stop_reason,
                                    r.prompt_tokens, r.completion_tokens)
                visit.done = True
                return web.Response(text=dumps(body), content_type="application/json")
        except RouterError as e:
            return web.json_response(error_body(e), status=e.status, headers=e.headers)


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    app.router.add_post("/v1/messages", MessagesEndpoint(ChatBridge(ctx.intake), ctx.tokenizer).handle)
