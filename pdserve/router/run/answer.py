"""The answer to one generation request, from its choices' deltas: one JSON response (:func:`collect`) or an SSE
stream (:func:`stream`), with logprobs, echo, tool calls and usage in the endpoint's shape."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web

from ..api.protocol import GenerationRequest
from ..api.response import SSE_DONE, ResponseBuilder, dumps, sse, usage_dict
from ..errors import RouterError, upstream_failed
from ..tracing import relay_span
from ..workers.client import WorkerError
from .choices import Choice, echo_prefix, merged, sum_usage
from .delta import Delta

log = logging.getLogger("pdserve.router")

DecodeOne = Callable[[int], str]  # one token id -> its text (the router's tokenizer)


def logprobs_part(req: GenerationRequest, c: Choice, d: Delta, first: bool, decode_one: DecodeOne) -> Any:
    """This delta's logprobs in the endpoint's shape (echo: the prompt's before the first delta's)."""
    if c.track is None:
        return None
    if req.kind == "chat":
        return c.track.chat_part(d.logprobs)
    part = c.track.completion(d.logprobs) if not (first and req.echo) else None
    if first and req.echo:
        head = c.track.prompt(c.prompt_ids, c.gen.prompt_logprobs, decode_one)
        tail = {} if req.score_only else c.track.completion(d.logprobs) or {}  # scoring: the prompt's alone
        part = {k: head[k] + tail.get(k, []) for k in head}
    return part

async def collect(req: GenerationRequest, choices: list[Choice], builder: ResponseBuilder, decode_one: DecodeOne
                  ) -> web.Response:
    """The whole answer as one JSON response."""
    async with aclosing(merged(choices)) as deltas:
        try:
            async for c, d in deltas:
                logprobs_part(req, c, d, not c.started, decode_one)
                c.started = True
                c.parts.append(d.text)
        except WorkerError as e:
            raise upstream_failed(str(e)) from None
    t = choices[0].gen.t
    t.end = time.perf_counter()
    out_choices = []
    for c in choices:
        text = c.text
        if req.echo:  # scoring (max_tokens 0): the prompt alone, as vLLM answers it
            text = echo_prefix(c, req.return_token_ids) + ("" if req.score_only else text)
        logprobs = None
        if c.track is not None:
            logprobs = c.track.chat_total() if req.kind == "chat" else c.track.completion_total()
        message, finish = None, c.gen.finish_reason
        if c.tools is not None:
            message, finish = c.tools.message(text, c.gen.token_ids, finish)
        out_choices.append(builder.choice(
            c.index, text, finish, c.gen.stop_reason, c.gen.token_ids, c.prompt_ids, logprobs,
            c.gen.prompt_logprobs if req.prompt_logprobs is not None else None, message))
    prompt_tokens, completion_tokens = sum_usage(choices)
    out = builder.response(out_choices, prompt_tokens, completion_tokens, choices[0].prompt_ids,
                           choices[0].gen.prompt_logprobs if req.prompt_logprobs is not None else None,
                           choices[0].prompt_text)
    if req.timings:
        out["pdserve_timings"] = t.report()
    return web.Response(text=dumps(out), content_type="application/json")

def _opening_chunks(req: GenerationRequest, choices: list[Choice], builder: ResponseBuilder) -> bytes:
    """Chat's first chunks, as vLLM 0.32 streams them: each choice's role (with the rendered prompt when
    ``return_prompt_text``), then (chat ``echo``) each choice's echo of the last message's content; each with the
    usage so far when continuous usage is on."""
    def opening(text: str, c: Choice, role: bool) -> bytes:
        chunk = builder.chunk(text, role=role, index=c.index)
        if role and req.return_prompt_text:
            chunk["prompt_text"] = c.prompt_text
        if req.continuous_usage:
            chunk["usage"] = usage_dict(len(c.prompt_ids), 0)
        return sse(chunk)

    out = b"".join(opening("", c, True) for c in choices)
    if req.chat_echo:
        out += b"".join(opening(req.chat_echo, c, False) for c in choices)
    return out


async def stream(request: web.Request, req: GenerationRequest, choices: list[Choice], builder: ResponseBuilder,
                 decode_one: DecodeOne) -> tuple[web.StreamResponse, str]:
    """Answer with SSE. Errors before the first token keep their HTTP status (raised); after it they become an
    error event followed by [DONE]. Returns (response, status label for the metrics)."""
    async with aclosing(merged(choices)) as deltas:
        try:
            first = await deltas.__anext__()
        except StopAsyncIteration:
            raise upstream_failed("worker produced no output") from None
        except WorkerError as e:
            raise upstream_failed(str(e)) from None
        except RouterError as e:
            if not e.event:
                raise
            return await refused_in_stream(request, req, e), "stream_error"
        resp = await _open(request, req)
        live = len(choices)
        try:
            item: tuple[Choice, Delta] | None = first
            out = _opening_chunks(req, choices, builder) if builder.chat else b""
            t = choices[0].gen.t
            plain = not req.continuous_usage and (req.logprobs is None or not req.token_details)
            held: dict[int, list[int]] = {}  # choice -> token ids of chunks the tool parser held back
            while item is not None:
                c, d = item
                if d.relay is not None:  # plain events as the worker's bytes, until one is not (run/relay.py)
                    if out:
                        await resp.write(out)
                        out = b""
                    r_head, r_tail = builder.relay_parts(c.index)
                    with relay_span(d.relay):  # a span per stretch when the request is traced (router/tracing/)
                        c.tokens += await d.relay.run(resp, request.transport, r_head, r_tail, builder.token_ids)
                    item = await deltas.__anext__()
                    continue
                text = d.text
                is_first = not c.started
                if plain and not is_first and d.finish_reason is None and c.tools is None:
                    # the common delta: its SSE bytes straight from the text (ResponseBuilder.text_chunk)
                    c.tokens += len(d.token_ids)
                    if text or req.token_details:  # without its ids a chunk with no text is not sent (vLLM's)
                        t0 = time.perf_counter()
                        await resp.write(out + builder.text_chunk(text, d.token_ids, c.index))
                        t.client.seconds += time.perf_counter() - t0
                        out = b""
                    item = await deltas.__anext__()
                    continue
                if is_first and req.echo:
                    text = echo_prefix(c, req.return_token_ids) + ("" if req.score_only else text)
                delta, finish = None, d.finish_reason
                if c.tools is not None:
                    delta = c.tools.delta(text, d.token_ids, c.prompt_ids, finish is not None)
                    finish = c.tools.finish_reason(finish)
                    if delta is None:
                        delta = {}  # nothing to show yet (e.g. inside a tool call's name)
                ids = held.pop(c.index, []) + d.token_ids if held else d.token_ids
                chunk = builder.chunk(text, ids, finish, d.stop_reason,
                                      prompt_ids=c.prompt_ids if is_first else None, index=c.index,
                                      logprobs=logprobs_part(req, c, d, is_first, decode_one), delta=delta)
                c.started = True
                c.tokens += len(d.token_ids)
                if req.continuous_usage:
                    chunk["usage"] = usage_dict(len(c.prompt_ids), c.tokens)
                if delta == {} and finish is None and chunk["choices"][0]["logprobs"] is None:
                    held[c.index] = ids  # their ids go out with the next chunk, so they all reach the client
                    item = await deltas.__anext__()  # the parser holds this text back (as vLLM skips it)
                    continue
                if not req.token_details and finish is None and not is_first and delta is None and not text:
                    item = await deltas.__anext__()  # nothing to show without its ids: vLLM sends no chunk either
                    continue
                if d.finish_reason is not None:
                    live -= 1
                if live == 0:
                    t.end = time.perf_counter()
                    tail = builder.usage_chunk(*sum_usage(choices)) if req.include_usage else None
                    if req.timings:
                        (tail if tail is not None else chunk)["pdserve_timings"] = t.report()
                    out += sse(chunk) + (sse(tail) if tail is not None else b"") + SSE_DONE
                    await resp.write(out)
                    break
                out += sse(chunk)
                t0 = time.perf_counter()
                await resp.write(out)
                t.client.seconds += time.perf_counter() - t0
                out = b""
                item = await deltas.__anext__()
        except (RouterError, WorkerError, StopAsyncIteration) as e:
            err = e if isinstance(e, RouterError) else upstream_failed(
                str(e) if isinstance(e, WorkerError) else "worker stream ended early")
            log.warning("request %s failed mid-stream: %s", req.request_id, err.message)
            await resp.write(sse(err.to_dict()) + SSE_DONE)
            await resp.write_eof()
            return resp, "stream_error"
        except ConnectionError:
            # client went away: leaving this block closes the worker streams, so vLLM aborts the requests
            return resp, "client_disconnected"
        try:
            await resp.write_eof()
        except ConnectionError:  # the client left after the last event, before the stream's end: nothing lost
            return resp, "client_disconnected"
        return resp, "200"


async def _open(request: web.Request, req: GenerationRequest) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-Id": req.request_id})
    await resp.prepare(request)
    return resp


async def refused_in_stream(request: web.Request, req: GenerationRequest, e: RouterError) -> web.StreamResponse:
    """A worker refused the request inside its stream before any output (``RouterError.event``): the client's
    stream is the same refusal, as one vLLM worker streams it (200, the error event, [DONE])."""
    log.info("request %s refused by its worker: %s %s", req.request_id, e.status, e.message)
    resp = await _open(request, req)
    try:
        await resp.write(sse(e.to_dict()) + SSE_DONE)
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp
