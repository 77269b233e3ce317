"""When a worker that continues an output shows the text one worker would (:class:`TextSync`).

D after P's first token, and a migrated attempt, get the output so far as part of their *prompt*; their detokenizer
is primed with it, where one worker would have streamed it. vLLM detokenizes with ``tokenizers``' ``DecodeStream``
(``FastIncrementalDetokenizer``), whose state is a window of token ids and that window's text: a step appends the
token, decodes the window and, when the text grew and does not end inside a character, emits the growth and starts
the window over at the tokens after its previous emission point. So the state after an emission at token k holds
exactly the tokens between the previous emission and k. Where the boundary (prompt + tokens so far) ends inside a
character, or the decoder is not concatenative at the boundary, the continuing worker's first text differs from one
worker's (it may re-emit prompt text); but two streams that emitted at the same two tokens hold the same window,
and from there the same tokens give the same text.

The router's own detokenizer (:class:`~..api.tokenizer.IncrementalDetokenizer`, primed as one worker primes it) is
therefore run only until the worker's stream is *settled*: two events in a row whose text equals the router's and
after whose last token the router's stream emitted (the worker's did too: its text for the event is the same
non-empty text). From then on the worker's own text is the output's, the router detokenizes nothing more, and its
plain events may pass through as bytes (:mod:`.relay`). Until then the event goes out with the router's text, as
before this check existed; a stream that never settles keeps the router's text to its end.
"""

from __future__ import annotations

from typing import Any

SETTLE_EVENTS = 2  # agreeing events in a row: the two shared emission points that make both windows the same


class TextSync:
    """Counts a continuing worker's events that agree with the router's detokenizer (see the module docstring)."""

    __slots__ = ("agreed",)

    def __init__(self) -> None:
        self.agreed = 0

    def settled(self, worker_text: Any, ours: str, emitted: bool) -> bool:
        """One event: the worker's ``text``, the router's text for the same tokens, whether the router's stream
        emitted at the event's last token. True once the worker's text can be taken as it is."""
        if emitted and ours and worker_text == ours:
            self.agreed += 1
        else:
            self.agreed = 0
        return self.agreed >= SETTLE_EVENTS
