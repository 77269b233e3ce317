"""A worker's output event as the router passes it on: text, token ids, finish, logprobs (:class:`Delta`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .relay import Relay


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: Any = None
    logprobs: Any = None  # the worker choice's raw ``logprobs`` for these tokens (vLLM completions shape), if asked
    relay: Relay | None = None  # no text: the stream's next plain events may be passed through (.relay)
    pieces: list[str] | None = None  # each token's text, when the router detokenized them (``text`` joins them)

    def upto(self, k: int) -> Delta:
        """The first k tokens of this delta (text unchanged: the caller has cut it); logprobs cut with them."""
        lp = self.logprobs
        if isinstance(lp, dict):
            lp = {key: v[:k] if isinstance(v, list) else v for key, v in lp.items()}
        return Delta(self.text, self.token_ids[:k], self.finish_reason, self.stop_reason, lp)


def tokens_to(pieces: list[str] | None, chars: int, n: int) -> int:
    """How many of a delta's n tokens (their texts ``pieces``) it takes to cover its first ``chars`` characters;
    n when the texts are unknown (the worker's own text)."""
    if pieces is None or len(pieces) != n:
        return n
    total = 0
    for i, piece in enumerate(pieces):
        total += len(piece)
        if total >= chars:
            return i + 1
    return n
