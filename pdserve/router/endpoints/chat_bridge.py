"""Runs a chat-completion request on the router's own chat path (P -> D) for another API's endpoint.

The Anthropic Messages (:mod:`.anthropic_messages`) and OpenAI Responses (:mod:`.responses`) endpoints translate their
request into a chat-completion body, as vLLM's own servers do, and run it here: the same parsing
(:func:`..api.protocol.parse_chat`), front door (:mod:`.intake`: admission, metrics, per-request checks, tools and
choices), chat template, placement, P -> D hand-off and stop strings as ``/v1/chat/completions``. What comes back
is the chat output in a neutral form: the streamed chat deltas (:meth:`ChatRun.pieces`, ``{"content"}`` and/or
``{"tool_calls"}`` as a chat chunk's ``delta``) or the whole message (:meth:`ChatRun.result`), which each endpoint
writes in its own shape.

One choice per request (the two APIs have no ``n``); the chat request is always run unstreamed as far as the
router's answer goes (no byte relay), since every event is rewritten.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any, Protocol

from aiohttp import web

from ..api.chat_output import ChatPiece, ChatResult
from ..api.protocol import GenerationRequest, parse_chat
from ..api.tools import ToolCalls
from ..errors import RouterError, upstream_failed
from ..run.choices import Choice, merged, sum_usage
from ..workers.client import WorkerError
from .intake import Intake, Visit

log = logging.getLogger("pdserve.router")

class EventWriter(Protocol):
    """An endpoint's streamed shape: its first events, the events of each chat delta, the last ones and an
    error event (each as SSE bytes)."""

    def start(self) -> bytes: ...

    def feed(self, piece: ChatPiece) -> bytes: ...

    def finish(self, piece: ChatPiece, completion_tokens: int) -> bytes: ...

    def error(self, e: RouterError) -> bytes: ...


class ChatRun:
    """One chat request on its way through P and D."""

    def __init__(self, req: GenerationRequest, choice: Choice, tools: ToolCalls | None) -> None:
        self.req = req
        self.choice = choice
        self.tools = tools
        self.status = "200"  # the metrics label; an error after the first event sets it

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def max_tokens(self) -> int:
        """The output budget the run has (the request's, or what the context leaves)."""
        return self.choice.gen.max_tokens

    @property
    def prompt_tokens(self) -> int:
        return len(self.choice.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.choice.gen.token_ids)

    async def pieces(self) -> AsyncGenerator[ChatPiece, None]:
        """The chat deltas as the chat endpoint streams them (tool calls parsed delta by delta). A worker's
        failure is raised as a :class:`RouterError` (502)."""
        c = self.choice
        async with aclosing(merged([c])) as deltas:
            try:
                async for _, d in deltas:
                    finish = d.finish_reason
                    delta: dict[str, Any] | None = {"content": d.text}
                    if self.tools is not None:
                        delta = self.tools.delta(d.text, d.token_ids, c.prompt_ids, finish is not None)
                        finish = self.tools.finish_reason(finish)
                    c.parts.append(d.text)
                    c.tokens += len(d.token_ids)
                    yield ChatPiece(delta or {}, finish, d.stop_reason if finish is not None else None,
                                    len(d.token_ids), self._logprobs(d.logprobs))
            except WorkerError as e:
                raise upstream_failed(str(e)) from None
        if c.gen.finish_reason is None:
            raise upstream_failed("worker stream ended early")

    async def result(self) -> ChatResult:
        """The whole answer, as the chat endpoint's unstreamed message (tool calls parsed from the whole text)."""
        c = self.choice
        async with aclosing(merged([c])) as deltas:
            try:
                async for _, d in deltas:
                    c.parts.append(d.text)
                    self._logprobs(d.logprobs)
            except WorkerError as e:
                raise upstream_failed(str(e)) from None
        c.gen.t.end = time.perf_counter()
        finish = c.gen.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if self.tools is not None:
            message, finish = self.tools.message(c.text, c.gen.token_ids, finish)
        prompt_tokens, completion_tokens = sum_usage([c])
        return ChatResult(message, finish, c.gen.stop_reason, prompt_tokens, completion_tokens,
                          None if c.track is None else c.track.chat_total()["content"])

    def _logprobs(self, raw: Any) -> list[dict[str, Any]] | None:
        """A delta's logprobs as chat's ``content`` entries (kept in the choice's track for the whole answer)."""
        track = self.choice.track
        part = None if track is None else track.chat_part(raw)
        return None if part is None else part["content"]


class ChatBridge:
    """What an endpoint needs of the router to run a chat body: the front door (:class:`~.intake.Intake`: admission,
    metrics, the per-request checks, tools and the choice builder) and the served model's answer name."""

    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    @property
    def max_body_bytes(self) -> int:
        return self.intake.config.max_body_bytes

    def answer_name(self, run: ChatRun) -> str:
        """The answer's ``model``: the adapter the request ran, else the served model."""
        return self.intake.models.answer_name(run.req.lora)

    def admitted(self, endpoint: str) -> AbstractAsyncContextManager[Visit]:
        """The front door's admission slot and metrics (:meth:`.intake.Intake.admitted`)."""
        return self.intake.admitted(endpoint)

    async def start(self, request: web.Request, chat_body: dict[str, Any], visit: Visit) -> ChatRun:
        """Parse the chat body, check it, tokenize and place: the run starts when its output is read."""
        req = parse_chat({k: v for k, v in chat_body.items() if k != "stream"})
        choices = await self.intake.start(req, request, chat_body, visit)
        assert len(choices) == 1, "one choice per request"
        return ChatRun(req, choices[0], choices[0].tools)

    async def stream(self, request: web.Request, run: ChatRun, writer: EventWriter
                     ) -> tuple[web.StreamResponse, str]:
        """Answer with the writer's SSE events. An error before the first chat delta keeps its HTTP status
        (raised); after it, it becomes the writer's error event. Returns (response, status label)."""
        pieces = run.pieces()
        try:
            try:
                first = await pieces.__anext__()
            except StopAsyncIteration:
                raise upstream_failed("worker produced no output") from None
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": run.request_id})
            await resp.prepare(request)
            try:
                out = writer.start()
                piece = first
                while piece.finish_reason is None:
                    out += writer.feed(piece)
                    await resp.write(out)
                    out = b""
                    piece = await pieces.__anext__()
                await resp.write(out + writer.feed(piece) + writer.finish(piece, run.completion_tokens))
            except (RouterError, StopAsyncIteration) as e:
                err = e if isinstance(e, RouterError) else upstream_failed("worker stream ended early")
                log.warning("request %s failed mid-stream: %s", run.request_id, err.message)
                await resp.write(writer.error(err))
                await resp.write_eof()
                return resp, "stream_error"
            except ConnectionError:  # the client left: closing the pieces aborts the workers' requests
                return resp, "client_disconnected"
            await resp.write_eof()
            return resp, "200"
        finally:
            await pieces.aclose()
