"""A streaming OpenAI-completions client that timestamps every chunk."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from .metrics import RequestRecord


async def stream_completion(session: aiohttp.ClientSession, base_url: str, payload: dict[str, Any],
                            timeout_s: float = 600.0, timings: bool = True) -> RequestRecord:
    """POST /v1/completions with stream=true and usage; record when each content chunk arrived.

    ``timings`` asks the pdserve router for its per-request phase timings (``pdserve_timings``); leave it off for
    servers that reject unknown fields."""
    body = dict(payload, stream=True, stream_options={"include_usage": True})
    if timings:
        body["pdserve_timings"] = True
    rec = RequestRecord(ok=False, start=time.monotonic())
    try:
        async with session.post(f"{base_url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for raw in resp.content:
                _consume_line(rec, raw.decode().strip(), time.monotonic())
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.end = time.monotonic()
    if not rec.output_tokens:  # no usage chunk: count content chunks
        rec.output_tokens = len(rec.chunk_times)
    rec.ok = rec.error is None and rec.first_token is not None
    return rec


def _consume_line(rec: RequestRecord, line: str, now: float) -> None:
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    if data == "[DONE]":
        return
    chunk = json.loads(data)
    if "error" in chunk:
        rec.error = str(chunk["error"].get("message", chunk["error"]))
        return
    if chunk.get("pdserve_timings"):
        rec.timings = chunk["pdserve_timings"]
    usage = chunk.get("usage")
    if usage:
        rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
        rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
    if any(c.get("text") for c in chunk.get("choices", [])):
        rec.first_token = rec.first_token or now
        rec.chunk_times.append(now)
