"""The Anthropic Messages API's answer shapes, as vLLM 0.32's ``/v1/messages`` writes them from a chat answer.

Whole answer (:func:`message_body`): ``{"id", "type": "message", "role": "assistant", "content": [blocks],
"model", "stop_reason", ["stop_sequence"], "usage": {"input_tokens", "output_tokens"}}``: a ``text`` block for
the content, a ``tool_use`` block per tool call (``input`` parsed from its arguments), one empty text block when
there is neither; null fields left out.

Streamed (:class:`MessageEvents`): SSE events ``event: NAME\\ndata: JSON``: ``message_start`` (usage with the
prompt's tokens), then per content block ``content_block_start``, ``content_block_delta`` (``text_delta`` or
``input_json_delta``), ``content_block_stop``; text that arrives while a tool call's block is open is held and
sent as a text block of its own when that block closes; then ``message_delta`` (stop reason, usage) and
``message_stop``. An error after the first event is an ``error`` event.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import RouterError, upstream_failed
from .chat_output import ChatPiece
from .response import dumps


def error_body(e: RouterError) -> dict[str, Any]:
    """Anthropic's error shape, as vLLM's /v1/messages answers an error."""
    return {"type": "error", "error": {"type": e.type, "message": e.message}}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def stop_reason(finish_reason: str | None, stop: Any, tool_used: bool, tool_complete: bool
                ) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) from the chat finish: length -> max_tokens; a finished tool call ->
    tool_use; a matched stop string -> stop_sequence (unless the tool calls are complete); else end_turn."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}


def message_body(msg_id: str, model: str, message: dict[str, Any], finish_reason: str | None, stop: Any,
                 prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    calls = message.get("tool_calls") or []
    reason, sequence = stop_reason(finish_reason, stop, bool(calls), bool(calls))
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in calls:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            raise upstream_failed(f"the tool call to {fn['name']!r} has arguments that are not JSON",
                                  "bad_tool_call") from None
        content.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args})
    out: dict[str, Any] = {"id": msg_id, "type": "message", "role": "assistant",
                           "content": content or [{"type": "text", "text": ""}], "model": model}
    if reason is not None:
        out["stop_reason"] = reason
    if sequence is not None:
        out["stop_sequence"] = sequence
    out["usage"] = usage(prompt_tokens, completion_tokens)
    return out


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {dumps(data)}\n\n".encode()


class MessageEvents:
    """The SSE events of one streamed answer, fed the chat deltas one by one."""

    def __init__(self, msg_id: str, model: str, prompt_tokens: int) -> None:
        self.msg_id = msg_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.index = 0  # the next block's index
        self.open_type: str | None = None
        self.open_tool: str | None = None  # the id of the open tool_use block
        self.held: list[str] = []  # text while a tool_use block is open
        self.tool_ids: dict[int, str] = {}  # tool call index -> its id
        self.tool_used = False
        self.last_args: list[str] = []

    def start(self) -> bytes:
        return event("message_start", {"type": "message_start", "message": {
            "id": self.msg_id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None, "usage": usage(self.prompt_tokens, 0)}})

    def _open(self, block: dict[str, Any]) -> bytes:
        self.open_type = block["type"]
        self.open_tool = block.get("id") if block["type"] == "tool_use" else None
        return event("content_block_start", {"type": "content_block_start", "content_block": block,
                                             "index": self.index})

    def _close(self) -> bytes:
        if self.open_type is None:
            return b""
        out = event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.open_type = self.open_tool = None
        self.index += 1
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": self.index})

    def _flush(self) -> bytes:
        """Close the open block; held text then goes out as a text block of its own."""
        out = self._close()
        if self.held:
            text = "".join(self.held)
            self.held.clear()
            out += self._open({"type": "text", "text": ""}) + self._delta({"type": "text_delta", "text": text})
            out += self._close()
        return out

    def feed(self, piece: ChatPiece) -> bytes:
        """The events of one chat delta (``{"content"}`` and/or ``{"tool_calls"}``)."""
        out = b""
        delta = piece.delta
        text = delta.get("content")
        if text:
            if self.open_type == "tool_use":
                self.held.append(text)
            else:
                if self.open_type != "text":
                    out += self._flush() + self._open({"type": "text", "text": ""})
                out += self._delta({"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or []:
            out += self._tool_call(call)
        return out

    def _tool_call(self, call: dict[str, Any]) -> bytes:
        out = b""
        fn = call.get("function") or {}
        call_id = call.get("id")
        if call_id is not None:
            self.tool_ids[call.get("index", 0)] = call_id
            if self.open_tool != call_id and fn.get("name") is not None:
                out += self._flush()
                self.tool_used = True
                self.last_args = []
                out += self._open({"type": "tool_use", "id": call_id, "name": fn["name"], "input": {}})
        else:
            call_id = self.tool_ids.get(call.get("index", 0))
        args = fn.get("arguments")
        if args and call_id is not None and self.open_tool == call_id:
            self.last_args.append(args)
            out += self._delta({"type": "input_json_delta", "partial_json": args})
        return out

    def finish(self, piece: ChatPiece, completion_tokens: int) -> bytes:
        """The last events: the open block's stop, ``message_delta`` and ``message_stop``."""
        out = self._flush()
        reason, sequence = stop_reason(piece.finish_reason or "stop", piece.stop_reason, self.tool_used,
                                       self.tool_used and _is_json("".join(self.last_args)))
        out += event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": usage(self.prompt_tokens, completion_tokens)})
        return out + event("message_stop", {"type": "message_stop"})

    def error(self, e: RouterError) -> bytes:
        return event("error", error_body(e))
