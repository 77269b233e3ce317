"""Beam search (``use_beam_search``), served as vLLM 0.32 serves it: by one worker, its answer relayed as it is.

vLLM runs beam search in its serving layer, not in its engine (``BeamSearchOnlineMixin.beam_search``: per step, one
one-token engine request per beam with ``2 x n`` logprobs, the beams ranked by cumulative logprob and
``length_penalty``), so no step can be split between a P and a D: the router places the whole request on one worker
that decodes (a decode, colocated or elastic worker; a prefill worker when none is live), through the conductor
like any whole request (``Placement.choose(..., whole=True)``), and sends it the client's body unchanged. The
worker's answer goes to the client with its status and body: vLLM's own refusals (a streamed completions request,
a value its request model refuses) in vLLM's status and shape, a streamed chat answer event by event. A worker that
never took the request is left out and the request placed again; a server error or a worker lost mid-answer is a
502 (nothing of the answer has gone out unless it streamed)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from ...hashing import domain_root
from ..errors import bad_request, deadline_exceeded, upstream_failed
from ..fleet.placement import Placement
from ..workers.client import WorkerClient, WorkerError

__all__ = ["BeamSearch", "refuse_crashing_values", "wants_beam_search"]

log = logging.getLogger("pdserve.router")
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
OWNED = ("kv_transfer_params", "ec_transfer_params")  # the router's own, refused by name as on every request
_SSE = "text/event-stream"


def wants_beam_search(body: Any) -> bool:
    """True when ``body`` asks for beam search: ``use_beam_search`` set to anything but false or null (a value
    vLLM's model cannot read as a boolean goes to the worker too, which refuses it in its own words)."""
    if not isinstance(body, dict):
        return False
    v = body.get("use_beam_search")
    return v not in (None, False, 0) and not (isinstance(v, str) and v.lower() in ("0", "off", "f", "false", "n",
                                                                                    "no"))


def refuse_crashing_values(body: dict[str, Any]) -> None:
    """Refuse (400, by name) the values vLLM 0.32's request model crashes on instead of refusing: its
    ``check_structured_outputs_count`` validator runs before the field's type check and calls ``.get`` on
    ``structured_outputs``, so anything but an object or null is an AttributeError there, a 500. The body goes to
    the worker otherwise unchecked: beam search builds no ``SamplingParams`` (no ``n`` / greedy rule, for one), and
    vLLM's own refusals come back in its words."""
    so = body.get("structured_outputs")
    if so is not None and not isinstance(so, dict):
        raise bad_request("'structured_outputs' must be an object", "structured_outputs")


class BeamSearch:
    """The whole request on one worker, relayed. ``prompt_ids``: the body's (first) prompt as token ids for the
    placement's prediction, or [] when the router cannot read it (the worker answers for it)."""

    def __init__(self, placement: Placement, client: Callable[[], WorkerClient],
                 prompt_ids: Callable[[str, dict[str, Any]], Awaitable[list[int]]],
                 request_timeout_s: float | None = None) -> None:
        self.placement = placement
        self.client = client
        self.prompt_ids = prompt_ids
        self.request_timeout_s = request_timeout_s  # the router's --request-timeout-s: 504 past it

    async def answer(self, request: web.Request, kind: str, body: dict[str, Any], lora: str | None = None
                     ) -> web.StreamResponse:
        """Place ``body`` whole, send it to that worker's endpoint of ``kind`` and relay the answer, within the
        request's deadline (504 ``request_timeout`` past it, before the answer starts; a streamed answer that
        started is cut there). vLLM says nothing until its beams are done, so no idle timeout applies."""
        started: list[web.StreamResponse] = []  # a streamed answer once its head went out
        try:
            return await asyncio.wait_for(self._answer(request, kind, body, lora, started), self.request_timeout_s)
        except asyncio.TimeoutError:
            if started:  # the client has the stream's head: it ends here, unfinished
                log.warning("beam search stream cut at the request deadline (%g s)", self.request_timeout_s)
                return started[0]
            raise deadline_exceeded(f"the beam search request did not finish within the request deadline of "
                                    f"{self.request_timeout_s:g} s (router --request-timeout-s)") from None

    async def _answer(self, request: web.Request, kind: str, body: dict[str, Any], lora: str | None,
                      started: list[web.StreamResponse]) -> web.StreamResponse:
        request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex  # the conductor's id
        for name in OWNED:
            if body.get(name) not in (None, False, [], {}):
                raise bad_request(f"'{name}' is not supported by the pdserve router", name, "unsupported_parameter")
        ids = await self.prompt_ids(kind, body)
        asked = body.get("max_tokens")
        max_tokens = asked if isinstance(asked, int) and not isinstance(asked, bool) else 16
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        domain = domain_root(salt, lora)  # placed by the blocks of its own key domain, as any request
        excluded: set[str] = set()
        while True:
            ticket = self.placement.choose(ids, frozenset(excluded), request_id, max_tokens, domain, whole=True)
            url = ticket.decode.url
            try:
                try:
                    resp = await self.client().post(url, PATHS[kind], body, idle=False)
                except WorkerError as e:
                    if e.kind != "connect":
                        raise upstream_failed(f"worker {url} failed with the beam search request: {e}") from None
                    if e.dead:
                        self.placement.registry.mark_dead(url, str(e))
                    log.warning("request %s: beam search on %s not accepted (%s); placing it again", request_id,
                                url, e)
                    excluded.add(url)
                    continue
                ticket.prefill_done()
                try:
                    return await self._relay(request, resp, url, started)
                finally:
                    resp.close()
            finally:
                ticket.close()

    @staticmethod
    async def _relay(request: web.Request, resp: aiohttp.ClientResponse, url: str,
                     started: list[web.StreamResponse]) -> web.StreamResponse:
        """The worker's answer as the client's: a 4xx and a 200 as they are (an SSE answer chunk by chunk), a server
        error or a lost connection as a 502."""
        ctype = resp.headers.get("Content-Type", "application/json")
        try:
            if resp.status >= 500:
                raise upstream_failed(f"worker {url} answered HTTP {resp.status} to the beam search request")
            if not ctype.startswith((_SSE, "application/json")):
                raise upstream_failed(f"worker {url} answered the beam search request with HTTP {resp.status} "
                                      f"({ctype or 'no content type'}), not vLLM's JSON")
            if not ctype.startswith(_SSE):
                raw = await resp.read()
                return web.Response(body=raw, status=resp.status, headers={"Content-Type": ctype})
        except (aiohttp.ClientError, TimeoutError) as e:
            raise upstream_failed(f"worker {url} was lost during the beam search request: {e}") from None
        out = web.StreamResponse(status=resp.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"})
        await out.prepare(request)
        started.append(out)
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except (aiohttp.ClientError, TimeoutError) as e:  # the stream has begun: it ends here, unfinished ([DONE]
            # missing), as one worker's stream ends when that worker dies
            log.warning("beam search stream from %s ended early: %s", url, e)
            return out
        await out.write_eof()
        return out
