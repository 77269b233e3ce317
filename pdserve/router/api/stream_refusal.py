"""A refused request's answer in vLLM 0.32's shape: a JSON error with its status; or, for a streamed request that
vLLM refuses from inside its stream (its engine's checks: logprobs over the worker's limit, an empty decoder
prompt, a thinking budget without reasoning, ... :attr:`RouterError.in_stream`), 200 with one error event and
``[DONE]``, as vLLM's ``create_streaming_error_response`` writes it (``type`` BadRequestError, ``code`` the
status)."""

from __future__ import annotations

from aiohttp import web

from ..errors import RouterError
from .response import SSE_DONE, sse


def refused_in_stream(e: RouterError, streamed: bool) -> bool:
    """Whether ``e`` is answered as a stream's error event (a streamed request, an in-stream refusal)."""
    return streamed and e.in_stream and e.status == 400


def refusal(e: RouterError, streamed: bool) -> web.Response:
    """The client's answer to ``e``."""
    if not refused_in_stream(e, streamed):
        return web.json_response(e.to_dict(), status=e.status, headers=e.headers)
    event = {"error": {"message": e.message, "type": "BadRequestError", "param": e.param, "code": e.status}}
    return web.Response(body=sse(event) + SSE_DONE, status=200, content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache"})
