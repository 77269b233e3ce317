"""A chat run's output in a neutral form, which the Messages and Responses endpoints write in their own shapes
(:mod:`.messages_stream`, :mod:`.responses_shape`): the streamed chat deltas (:class:`ChatPiece`) or the whole
message (:class:`ChatResult`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ChatPiece:
    """One streamed chat delta: ``delta`` as a chat chunk's (may be empty), the finish on the last."""

    delta: dict[str, Any]
    finish_reason: str | None = None
    stop_reason: Any = None
    tokens: int = 0
    logprobs: list[dict[str, Any]] | None = None  # chat's logprobs ``content`` entries of these tokens, if asked


@dataclass
class ChatResult:
    """The whole chat answer: the assistant message (``content``, ``tool_calls``) and how it ended."""

    message: dict[str, Any]
    finish_reason: str | None
    stop_reason: Any
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None = None  # chat's logprobs ``content``, if asked
