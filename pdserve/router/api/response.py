"""The answers in each endpoint's shape: whole responses and SSE chunks (:class:`ResponseBuilder`), usage, and the
JSON/SSE encoding."""

from __future__ import annotations

import json
import time
from typing import Any

from .protocol import GenerationRequest


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# ---- responses ----

def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseBuilder:
    """Builds one request's response objects (full or SSE chunks) in the shape of its endpoint."""

    def __init__(self, req: GenerationRequest, model_name: str) -> None:
        self.req = req
        self.model = model_name
        self.created = int(time.time())
        self.chat = req.kind == "chat"
        self.token_ids = req.return_token_ids and req.token_details  # each choice's (the prompt's: return_token_ids)
        base = dumps(self._base("chat.completion.chunk" if self.chat else "text_completion"))[:-1]
        self._text_head = (base + ',"choices":[{"index":').encode()
        self._text_mid = b',"delta":{"content":' if self.chat else b',"text":'
        self._text_tail = (b'},' if self.chat else b',') + b'"logprobs":null,"finish_reason":null'

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.req.response_id or self.req.request_id, "object": obj, "created": self.created,
                "model": self.model}

    def choice(self, index: int, text: str, finish_reason: str | None, stop_reason: Any, token_ids: list[int],
               prompt_ids: list[int] | None = None, logprobs: Any = None, prompt_logprobs: Any = None,
               message: dict[str, Any] | None = None) -> dict[str, Any]:
        """One finished choice. ``message`` (chat) replaces ``{"role": <the answer's role>, "content": text}``; chat
        ``echo`` puts the last message's content before the content (both as vLLM 0.32)."""
        if self.chat:
            msg = {"role": self.req.response_role, "content": text} if message is None \
                else {**message, "role": self.req.response_role}
            if self.req.chat_echo:
                msg["content"] = self.req.chat_echo + (msg.get("content") or "")
            choice: dict[str, Any] = {"index": index, "message": msg, "logprobs": logprobs,
                                      "finish_reason": finish_reason, "stop_reason": stop_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
        if self.token_ids:
            choice["token_ids"] = token_ids
        if self.req.return_token_ids and not self.chat:
            choice["prompt_token_ids"] = prompt_ids
        return choice

    def response(self, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int,
                 prompt_ids: list[int] | None = None, prompt_logprobs: Any = None, prompt_text: str = ""
                 ) -> dict[str, Any]:
        out = self._base("chat.completion" if self.chat else "text_completion")
        if self.chat and self.req.return_token_ids:
            out["prompt_token_ids"] = prompt_ids
        if self.chat and self.req.return_prompt_text:
            out["prompt_text"] = prompt_text
        out["choices"] = choices
        out["usage"] = usage_dict(prompt_tokens, completion_tokens)
        if self.chat and prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs
        return out

    def full(self, text: str, finish_reason: str | None, stop_reason: Any, token_ids: list[int],
             prompt_tokens: int, prompt_ids: list[int] | None) -> dict[str, Any]:
        """A one-choice response."""
        return self.response([self.choice(0, text, finish_reason, stop_reason, token_ids, prompt_ids)],
                             prompt_tokens, len(token_ids), prompt_ids)

    def chunk(self, text: str, token_ids: list[int] | None = None, finish_reason: str | None = None,
              stop_reason: Any = None, role: bool = False, prompt_ids: list[int] | None = None, index: int = 0,
              logprobs: Any = None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        """One SSE chunk of choice ``index``. ``delta`` (chat) replaces ``{"content": text}``."""
        if self.chat:
            body = delta if delta is not None else {"content": text}
            d: dict[str, Any] = {"role": self.req.response_role, **body} if role else body
            choice: dict[str, Any] = {"index": index, "delta": d, "logprobs": logprobs,
                                      "finish_reason": finish_reason}
            out = self._base("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            out = self._base("text_completion")
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        if self.token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        if self.req.return_token_ids and token_ids is not None and prompt_ids is not None:
            if self.chat:
                out["prompt_token_ids"] = prompt_ids
            else:
                choice["prompt_token_ids"] = prompt_ids
        out["choices"] = [choice]
        return out

    def text_chunk(self, text: str, token_ids: list[int], index: int = 0) -> bytes:
        """``sse(self.chunk(text, token_ids, index=index))`` byte for byte, for the common streamed delta (no
        finish, logprobs, role, prompt ids or tool delta), without building and encoding the whole object."""
        out = self._text_head + str(index).encode() + self._text_mid + dumps(text).encode() + self._text_tail
        if self.token_ids:
            out += b',"token_ids":' + dumps(token_ids).encode()
        return b"data: " + out + b"}]}\n\n"

    def relay_parts(self, index: int = 0) -> tuple[bytes, bytes]:
        """(head, tail) of :meth:`text_chunk`'s bytes around the text's JSON string: ``head + json_text + tail +
        [token_ids list if token_ids] + b"}]}\n\n"`` is ``text_chunk`` (the relay splices the worker's raw JSON
        text and ids in)."""
        head = b"data: " + self._text_head + str(index).encode() + self._text_mid
        tail = self._text_tail + (b',"token_ids":' if self.token_ids else b"")
        return head, tail

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        out = self._base("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = usage_dict(prompt_tokens, completion_tokens)
        return out


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
