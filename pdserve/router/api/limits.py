"""Input limits the router enforces before any costly work: body size, JSON nesting depth, prompt length.

- Body size: ``RouterConfig.max_body_bytes`` (``--max-body-bytes``, default 4 MiB) is aiohttp's
  ``client_max_size``; a larger body is refused with 413 (:func:`body_too_large`) before it is parsed.
- JSON nesting: a body nested deeper than :data:`MAX_JSON_DEPTH` objects/arrays is refused with 400, whether
  the parser itself gives up (``RecursionError``) or it parses and a later step would recurse through it.
- Prompt length: a prompt whose text is longer in characters than ``max_model_len`` tokens could hold is refused
  with 400 (vLLM's ``context_length_exceeded`` shape) without tokenizing. The bound is ``max_model_len`` x the
  most characters one token can cover: the longest token of the vocabulary, and never less than
  :data:`MIN_CHARS_PER_TOKEN` (16, generous: English text averages about 4).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from ...settings.table import DEFAULT_MAX_BODY_BYTES  # noqa: F401  (declared once, with --max-body-bytes)
from ..errors import RouterError, bad_request

MAX_JSON_DEPTH = 64  # OpenAI request bodies nest a handful of levels; 64 leaves room for any real client
MIN_CHARS_PER_TOKEN = 16


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} bytes"


def body_too_large(limit: int) -> RouterError:
    return RouterError(413, f"request body is larger than the router's limit of {limit} bytes ({_human(limit)}); "
                            "start the router with a larger --max-body-bytes to accept it",
                       "invalid_request_error", None, "request_too_large")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, refused (413) before reading when its declared length is over ``limit`` and while
    reading when it grows past it (aiohttp's ``client_max_size`` is the same limit)."""
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(limit) from None


def _too_deep() -> RouterError:
    return bad_request(f"request body nests objects/arrays deeper than {MAX_JSON_DEPTH} levels", None,
                       "json_too_deep")


_CONTAINERS = (dict, list)  # what json.loads builds for objects and arrays


def nesting_exceeds(obj: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when ``obj`` (parsed JSON) nests dicts/lists more than ``limit`` levels; iterative (no recursion)."""
    if not isinstance(obj, _CONTAINERS):
        return False
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if type(child) in _CONTAINERS)
    return False


def load_json(raw: bytes, what: str = "request body") -> Any:
    """Parse a request body: 400 when it is not JSON or nests too deeply (never a RecursionError)."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"{what} is not valid JSON: {e}") from None
    # a body with fewer brackets than the limit cannot nest past it (brackets inside strings only over-count)
    if isinstance(obj, _CONTAINERS) and raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and nesting_exceeds(obj):
        raise _too_deep()
    return obj


def max_prompt_chars(max_model_len: int, chars_per_token: int) -> int:
    return max_model_len * max(MIN_CHARS_PER_TOKEN, chars_per_token)


def check_prompt_chars(chars: int, max_model_len: int, chars_per_token: int, param: str) -> None:
    """400 (as vLLM words a too-long prompt) when ``chars`` of prompt text cannot fit ``max_model_len`` tokens."""
    bound = max_prompt_chars(max_model_len, chars_per_token)
    if chars > bound:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                          f"{chars} characters, more than {max_model_len} tokens can hold (at most {bound} characters"
                          "). Please reduce the length of the prompt.", param, "context_length_exceeded")
