"""POST /v1/completions and /v1/chat/completions: a body through the front door (:mod:`.intake`), its choices'
deltas answered as one JSON response or as SSE (:mod:`..run.answer`)."""

from __future__ import annotations

from aiohttp import web

from ..api.protocol import GenerationRequest, parse_chat, parse_completion, parse_json
from ..api.response import ResponseBuilder
from ..api.tokenizer import PromptTokenizer
from ..errors import RouterError
from ..run.answer import collect, refused_in_stream, stream
from ..run.beam_search import refuse_crashing_values, wants_beam_search
from .context import RouterContext
from .intake import Intake


class GenerateEndpoint:
    """One of the two endpoints: ``kind`` is "completions" or "chat" (the metrics' endpoint label too)."""

    def __init__(self, intake: Intake, tokenizer: PromptTokenizer, kind: str) -> None:
        self.intake = intake
        self.tokenizer = tokenizer
        self.kind = kind

    async def handle(self, request: web.Request) -> web.StreamResponse:
        door = self.intake
        req: GenerationRequest | None = None
        try:
            async with door.admitted(self.kind) as visit:
                try:
                    body = parse_json(await door.read_body(request))
                    if wants_beam_search(body):  # vLLM's serving layer runs it: the whole request on one worker
                        lora = door.models.adapter(body.get("model"))  # 404 for an unknown model, as always
                        refuse_crashing_values(body)  # what vLLM's request model answers with a 500
                        resp = await door.beam.answer(request, self.kind, body, lora)
                        visit.status = str(resp.status)
                        return resp
                    req = parse_chat(body) if self.kind == "chat" else parse_completion(body)
                    choices = await door.start(req, request, body, visit)
                except RouterError as e:
                    if not (e.event and req is not None and req.stream):
                        raise
                    visit.status = "stream_error"  # refused as vLLM refuses it: inside its stream
                    return await refused_in_stream(request, req, e)
                builder = ResponseBuilder(req, door.models.answer_name(req.lora))
                if req.stream:
                    resp, visit.status = await stream(request, req, choices, builder, self.tokenizer.decode_one)
                else:
                    resp = await collect(req, choices, builder, self.tokenizer.decode_one)
                visit.done = True
                return resp
        except RouterError as e:
            return web.json_response(e.to_dict(), status=e.status, headers=e.headers)


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    app.router.add_post("/v1/completions", GenerateEndpoint(ctx.intake, ctx.tokenizer, "completions").handle)
    app.router.add_post("/v1/chat/completions", GenerateEndpoint(ctx.intake, ctx.tokenizer, "chat").handle)
