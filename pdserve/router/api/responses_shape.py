"""The OpenAI Responses API's answer shapes, as vLLM 0.32's ``/v1/responses`` writes them (non-harmony models).

The response object (:meth:`ResponseShape.body`) echoes the request (instructions, tools, tool_choice,
sampling values, ...) around the ``output`` items and ``usage``; ``status`` is ``incomplete`` (with
``incomplete_details.reason = max_output_tokens``) when the output hit its token limit, else ``completed``.
Output items: a ``message`` with one ``output_text`` part, and a ``function_call`` per tool call.

Streamed (:class:`ResponseEvents`): ``event: NAME\\ndata: JSON`` events, each with its ``sequence_number``:
``response.created``, ``response.in_progress``, then per output item ``response.output_item.added``, for a
message ``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, for a function call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``; ``response.output_item.done``; last ``response.completed`` with the
whole response (its output the streamed items). An error after the first event is an ``error`` event.

Output logprobs (``include: ["message.output_text.logprobs"]``) come from the chat path's logprobs, reshaped.

Known differences from one vLLM worker (documented in docs/architecture.md): ``usage.input_tokens_details.
cached_tokens`` is 0 (the router does not see the workers' prefix-cache hits), and ``temperature`` / ``top_p``
echo the request or 1.0 (vLLM echoes the model's generation-config defaults when the request has none).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..errors import RouterError
from .chat_output import ChatPiece
from .response import dumps

_TOOL_ECHO_NULLS = ("allowed_callers", "async", "defer_loading")


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:16]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                                     "cached_tokens_per_turn": []},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Chat's logprobs entries in the output text's shape (``token, bytes, logprob, top_logprobs``)."""
    if entries is None:
        return None
    return [{"token": e["token"], "bytes": e["bytes"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "bytes": t["bytes"], "logprob": t["logprob"]}
                              for t in e.get("top_logprobs") or []]} for e in entries]


def delta_logprobs(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A text delta event's logprobs (``token, logprob, top_logprobs``, no bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in logprobs(entries) or []]


def message_item(item_id: str, text: str | None, done: bool = True, lps: list[dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
    content: list[dict[str, Any]] = [] if text is None else [
        {"annotations": [], "text": text, "type": "output_text", "logprobs": lps}]
    return {"id": item_id, "content": content, "role": "assistant", "status": "completed" if done else "in_progress",
            "type": "message", "phase": None}


def call_item(item_id: str, call_id: str, name: str, arguments: str, done: bool = True) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name, "type": "function_call", "id": item_id,
            "async": None, "caller": None, "namespace": None, "status": "completed" if done else "in_progress"}


def output_items(message: dict[str, Any], with_tools: bool, lps: list[dict[str, Any]] | None = None
                 ) -> list[dict[str, Any]]:
    """A whole chat message as output items: the text (always without tools, as vLLM's fallback; with tools
    only when there is some, as its parser path), then the tool calls."""
    items = []
    text = message.get("content")
    if text or not with_tools:
        items.append(message_item(new_id("msg_"), text or None, lps=logprobs(lps) or None))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append(call_item(new_id("fc_"), call["id"], fn["name"], fn["arguments"]))
    return items


def _tool_echo(tool: dict[str, Any]) -> dict[str, Any]:
    out = {"name": tool.get("name"), "parameters": tool.get("parameters"), "strict": tool.get("strict"),
           "type": "function"}
    for key in _TOOL_ECHO_NULLS:
        out[key] = tool.get(key)
    out["description"] = tool.get("description")
    out["output_schema"] = tool.get("output_schema")
    return out


def _float(v: Any, default: float) -> float:
    return float(v) if v is not None else default


class ResponseShape:
    """One request's response object, echoing the request's fields."""

    def __init__(self, body: dict[str, Any], model: str, max_tokens: int) -> None:
        self.body = body
        self.model = model
        self.max_tokens = max_tokens
        self.id = body["request_id"] if isinstance(body.get("request_id"), str) and body["request_id"] \
            else new_id("resp_")
        self.created = int(time.time())
        self.tools = [_tool_echo(t) for t in body.get("tools") or []]
        # vLLM echoes the sampling's logprobs: top_logprobs when output logprobs are included, else null
        self.top_logprobs = (body.get("top_logprobs") or 0) if "message.output_text.logprobs" in (
            body.get("include") or []) else None

    def _tool_choice(self) -> Any:
        choice = self.body.get("tool_choice", "auto")
        if not self.tools and choice in ("auto", "none", None):
            return "none"
        if isinstance(choice, dict):
            return {"name": choice.get("name"), "type": "function"}
        return choice

    def response(self, output: list[dict[str, Any]], status: str, use: dict[str, Any] | None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "metadata": b.get("metadata"), "model": self.model,
            "object": "response", "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls") if b.get("parallel_tool_calls") is not None
            else True,
            "temperature": _float(b.get("temperature"), 1.0), "tool_choice": self._tool_choice(),
            "tools": self.tools, "top_p": _float(b.get("top_p"), 1.0), "background": False,
            "max_output_tokens": self.max_tokens, "max_tool_calls": b.get("max_tool_calls"),
            "previous_response_id": None, "prompt": None, "reasoning": b.get("reasoning"),
            "service_tier": b.get("service_tier") or "auto", "status": status, "text": b.get("text"),
            "top_logprobs": self.top_logprobs, "truncation": b.get("truncation") or "disabled", "usage": use,
            "user": b.get("user"), "presence_penalty": _float(b.get("presence_penalty"), 0.0),
            "frequency_penalty": _float(b.get("frequency_penalty"), 0.0), "kv_transfer_params": None,
            "ec_transfer_params": None, "input_messages": None, "output_messages": None}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponseEvents:
    """The SSE events of one streamed answer, fed the chat deltas one by one."""

    def __init__(self, shape: ResponseShape, prompt_tokens: int) -> None:
        self.shape = shape
        self.prompt_tokens = prompt_tokens
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the closed output items
        self.state: str | None = None  # "content" | "tool"
        self.item_id = ""
        self.text: list[str] = []
        self.call: dict[str, Any] = {}  # the open call: call_id, name, index
        self.lps: list[dict[str, Any]] | None = None  # the open text's logprobs (None: not asked)

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        data = {**data, "sequence_number": self.seq, "type": kind}
        self.seq += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n".encode()

    def _ref(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.items)}

    def start(self) -> bytes:
        first = self.shape.response([], "in_progress", None)
        return self._event("response.created", {"response": first}) + \
            self._event("response.in_progress", {"response": first})

    def _close(self) -> bytes:
        out = b""
        text = "".join(self.text)
        if self.state == "content":
            out += self._event("response.output_text.done", {"content_index": 0, "item_id": self.item_id,
                                                            "logprobs": [], "output_index": len(self.items),
                                                            "text": text})
            item = message_item(self.item_id, text, lps=self.lps or None)
            out += self._event("response.content_part.done", {"content_index": 0, **self._ref(),
                                                             "part": item["content"][0]})
        elif self.state == "tool":
            out += self._event("response.function_call_arguments.done", {"arguments": text, **self._ref(),
                                                                        "name": self.call["name"]})
            item = call_item(self.item_id, self.call["call_id"], self.call["name"], text)
        else:
            return b""
        out += self._event("response.output_item.done", {"item": item, "output_index": len(self.items)})
        self.items.append(item)
        self.state, self.text = None, []
        return out

    def _content(self, text: str, lps: list[dict[str, Any]] | None) -> bytes:
        out = b""
        if self.state != "content":
            out += self._close()
            self.state, self.item_id, self.lps = "content", new_id("msg_"), []
            out += self._event("response.output_item.added", {"item": message_item(self.item_id, None, False),
                                                             "output_index": len(self.items)})
            out += self._event("response.content_part.added", {
                "content_index": 0, **self._ref(),
                "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}})
        self.text.append(text)
        if self.lps is not None:
            self.lps += logprobs(lps) or []
        return out + self._event("response.output_text.delta", {"content_index": 0, "delta": text,
                                                               "item_id": self.item_id,
                                                               "logprobs": delta_logprobs(lps),
                                                               "output_index": len(self.items)})

    def _tool_calls(self, calls: list[dict[str, Any]]) -> bytes:
        out = b""
        first = calls[0]
        fn = first.get("function")
        if fn is None:
            return b""
        index = first.get("index", 0)
        if self.state != "tool" or self.call.get("index") != index:
            out += self._close()
            self.state, self.item_id = "tool", new_id("fc_")
            self.call = {"call_id": first.get("id") or new_id("call_"), "name": fn.get("name") or "", "index": index}
            out += self._event("response.output_item.added", {
                "item": call_item(self.item_id, self.call["call_id"], self.call["name"], "", False),
                "output_index": len(self.items)})
        args = "".join((c.get("function") or {}).get("arguments") or "" for c in calls)
        if args:
            self.text.append(args)
            out += self._event("response.function_call_arguments.delta", {"delta": args, **self._ref()})
        return out

    def feed(self, piece: ChatPiece) -> bytes:
        out = b""
        if piece.delta.get("content"):
            out += self._content(piece.delta["content"], piece.logprobs)
        if piece.delta.get("tool_calls"):
            out += self._tool_calls(piece.delta["tool_calls"])
        return out

    def finish(self, piece: ChatPiece, completion_tokens: int) -> bytes:
        out = self._close()
        final = self.shape.response(self.items, status_of(piece.finish_reason),
                                    usage(self.prompt_tokens, completion_tokens))
        return out + self._event("response.completed", {"response": final})

    def error(self, e: RouterError) -> bytes:
        return self._event("error", {"code": e.code, "message": e.message, "param": e.param})
