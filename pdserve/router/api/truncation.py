"""``truncate_prompt_tokens`` and ``truncation_side``, served as one vLLM 0.32 worker serves them.

The router tokenizes every prompt, so it truncates before placement: P, D and the conductor see the truncated
prompt, and ``usage.prompt_tokens`` counts it. vLLM's rules (``vllm/renderers/params.py``, ``TokenizeParams``):

- ``truncate_prompt_tokens`` is ``None`` (no truncation) or an integer >= -1; a value over ``max_model_len`` is a
  400 naming it. ``-1`` keeps ``max_model_len - 1`` tokens when the request asks for output tokens
  (``max_tokens``; completions default to 16), else ``max_model_len``. ``0`` keeps no token.
- ``truncation_side``: ``"left"`` keeps the last N tokens, ``"right"`` the first N; unset, the tokenizer's side,
  which vLLM sets to ``"left"`` for generative models. It acts only with ``truncate_prompt_tokens``.
- A text prompt with an explicit side is first cut to ``max_model_len`` times the longest vocabulary entry in
  characters (from that side), then tokenized whole and sliced. Without a side, the tokenizer truncates
  (``truncation=True, max_length=N``, left), which keeps its special tokens, then the ids are sliced.
- Token-id prompts are sliced only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import RouterError, bad_request, model_param
from .lax_values import integral

_INT64_MAX = 2 ** 63 - 1
SIDES = ("left", "right")
DEFAULT_SIDE = "left"  # vLLM's tokenizer side for generative models (vllm/tokenizers/registry.py)


@dataclass(frozen=True)
class Truncation:
    """A request's truncation as asked: ``tokens`` (-1 or >= 0) and ``side`` (None: the tokenizer's, left)."""

    tokens: int
    side: str | None = None

    def keep(self, max_model_len: int, max_output_tokens: int) -> int:
        """How many prompt tokens to keep (vLLM's ``max_truncation_tokens`` for -1)."""
        if self.tokens >= 0:
            return self.tokens
        return max(0, max_model_len - 1) if max_output_tokens else max_model_len

    def cut_text(self, text: str, max_model_len: int, chars_per_token: int) -> str:
        """vLLM's character pre-cut: with an explicit side, text longer than ``max_model_len`` tokens could hold."""
        limit = max_model_len * chars_per_token
        if self.side is None or chars_per_token <= 0 or len(text) <= limit:
            return text
        return text[-limit:] if self.side == "left" else text[:limit]

    def cut_ids(self, ids: list[int], keep: int) -> list[int]:
        """The ids truncation keeps, from its side."""
        if keep >= len(ids):
            return ids
        if keep == 0:
            return []
        return ids[-keep:] if (self.side or DEFAULT_SIDE) == "left" else ids[:keep]


def parse_truncation(body: dict[str, Any]) -> Truncation | None:
    """The request's truncation (None: not asked), its fields checked as vLLM's request models check them."""
    side = body.get("truncation_side")
    if side is not None and side not in SIDES:
        raise bad_request(f"'truncation_side' must be 'left' or 'right', got {side!r}", model_param("truncation_side"))
    tokens = integral(body.get("truncate_prompt_tokens"))
    if tokens is None:
        return None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not -1 <= tokens <= _INT64_MAX:
        raise bad_request(f"'truncate_prompt_tokens' must be an integer >= -1, got {tokens!r}",
                          model_param("truncate_prompt_tokens"))
    return Truncation(tokens, side)


def check_truncation(trunc: Truncation | None, max_model_len: int) -> None:
    """vLLM's 400 for a truncation size over the context length."""
    if trunc is not None and trunc.tokens > max_model_len:
        raise bad_request(f"truncate_prompt_tokens={trunc.tokens} cannot be greater than max_model_len = "
                          f"{max_model_len}. Please request a smaller truncation size.", "truncate_prompt_tokens")


class TextEncoder(Protocol):
    """What truncation needs of the router's tokenizer (:class:`.tokenizer.PromptTokenizer`)."""

    @property
    def chars_per_token(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]: ...


def truncated_text_ids(tok: TextEncoder, text: str, trunc: Truncation, max_model_len: int, max_output_tokens: int,
                       add_special_tokens: bool) -> list[int]:
    """A text prompt's ids after vLLM's truncation (the character pre-cut, the tokenizer's cut, the slice)."""
    keep = trunc.keep(max_model_len, max_output_tokens)
    if keep == 0:
        return []
    text = trunc.cut_text(text, max_model_len, tok.chars_per_token)
    ids = tok.encode(text, add_special_tokens, None if trunc.side is not None else keep)
    return trunc.cut_ids(ids, keep)


def truncated_ids(ids: list[int], trunc: Truncation, max_model_len: int, max_output_tokens: int) -> list[int]:
    """A token-id prompt after vLLM's truncation."""
    return trunc.cut_ids(ids, trunc.keep(max_model_len, max_output_tokens))


def truncated_max_tokens(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The output budget of a truncated prompt, as vLLM 0.32 gives it: ``max_tokens`` clamped to the room left in
    the context (vLLM's ``get_max_tokens``), a 400 when no token is left, and vLLM's 400 for an empty prompt."""
    if prompt_tokens == 0:  # vLLM's engine checks it: inside the stream of a streamed request
        raise RouterError(400, "The decoder prompt cannot be empty", "BadRequestError", event=True)
    room = max_model_len - prompt_tokens
    if room <= 0:
        raise bad_request(f"max_tokens must be at least 1, got {room}.", "max_tokens")
    return room if max_tokens is None else min(max_tokens, room)
