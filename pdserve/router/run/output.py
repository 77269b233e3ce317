"""What the client has been given of one request's output (:class:`Output`): its tokens, the text through the
router's stop strings, its finish, and where the router's own detokenizer is; every counted token is reported to
the placement in force (the conductor's progress). One per request's run, shared by its attempts across a
migration or a move, so text, stop strings and usage run on where the last worker stopped."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Histogram

from ..api.tokenizer import IncrementalDetokenizer
from ..fleet.ticket import PlacementTicket
from .delta import Delta, tokens_to
from .stops import StopStrings
from .textsync import TextSync
from .timings import Timings


class Output:
    """One request's output so far (see the module docstring). ``ticket``: the placement the run is on now;
    ``gap_since``: perf_counter of a move's stop on the old worker, until the first token after it (``gap``)."""

    def __init__(self, stopper: StopStrings, t: Timings, detok: IncrementalDetokenizer | None = None,
                 gap: Histogram | None = None) -> None:
        self.stopper = stopper
        self.t = t
        self.detok = detok  # P -> D: text from the router's detokenizer (see IncrementalDetokenizer)
        self.gap = gap
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.prompt_logprobs: Any = None  # the worker's ``prompt_logprobs`` (P's, or the whole-request worker's)
        self.ticket: PlacementTicket | None = None
        self.gap_since: float | None = None
        self.detok_fed = 0  # tokens the detokenizer has been given, in output order

    def delta(self, ids: list[int], c0: dict[str, Any], own: bool, final: bool = False) -> Delta:
        """A worker event's delta. Its text: the router's detokenizer's when ``own`` (P -> D, or a migrated
        attempt; each token's piece kept, so a stop string can cut the tokens too), else the worker's."""
        finish, stop = (c0.get("finish_reason"), c0.get("stop_reason")) if final else (None, None)
        if own and self.detok is not None:
            self.detok_fed += len(ids)
            pieces = [self.detok.step(t) for t in ids]
            return Delta("".join(pieces), ids, finish, stop, c0.get("logprobs"), pieces=pieces)
        text = c0.get("text")
        return Delta(text if isinstance(text, str) else "", ids, finish, stop, c0.get("logprobs"))

    def settled(self, sync: TextSync, c0: dict[str, Any], ours: Delta) -> bool:
        """A continuing worker's event (``c0``) whose text the router made (``ours``): True once the worker's own
        text is the output's from the next event on (:mod:`.textsync`; at once without a detokenizer of the
        router's, whose text is then the worker's anyway)."""
        detok = self.detok
        return detok is None or sync.settled(c0.get("text"), ours.text, detok.emitted)

    def catch_up(self) -> None:
        """Before a migrated attempt: give the detokenizer the streamed tokens whose text came from a worker
        (that text is out already), so it goes on exactly where the output is."""
        if self.detok is not None and self.detok_fed < len(self.token_ids):
            for t in self.token_ids[self.detok_fed:]:
                self.detok.step(t)
            self.detok_fed = len(self.token_ids)

    def accept(self, raw: Delta) -> Delta:
        """A worker's delta -> the client's: stop strings, token accounting, the conductor's progress."""
        if raw.relay is not None:
            return raw  # the relay does the accounting of what it passes through
        if not self.stopper.stops and raw.finish_reason is None:
            self.count(raw.token_ids)
            return raw  # nothing to cut or hold back: the worker's delta as it is
        before = len(self.stopper.text)
        text, hit = self.stopper.feed(raw.text)
        if hit is not None:  # the tokens after the one that completes the stop string were not output (vLLM)
            raw = raw.upto(tokens_to(raw.pieces, self.stopper.matched_end - before, len(raw.token_ids)))
            self.count(raw.token_ids)
            self.finish_reason, self.stop_reason = "stop", hit
            return Delta(text, raw.token_ids, "stop", hit, raw.logprobs)
        self.count(raw.token_ids)
        if raw.finish_reason is not None:
            self.finish_reason, self.stop_reason = raw.finish_reason, raw.stop_reason
            return Delta(text + self.stopper.flush(), raw.token_ids, raw.finish_reason, raw.stop_reason,
                         raw.logprobs)
        return Delta(text, raw.token_ids, logprobs=raw.logprobs)

    def count(self, ids: list[int]) -> None:
        """Output tokens: kept, timed, and reported to the placement (the conductor's progress)."""
        if not ids:
            return
        self.token_ids.extend(ids)
        t = self.t
        t.tokens += len(ids)
        now = time.perf_counter()
        if t.first_token is None:
            t.first_token = now
        if self.gap_since is not None:  # the first token after a move
            if self.gap is not None:
                self.gap.observe(now - self.gap_since)
            self.gap_since = None
        t.last_token = now
        if self.ticket is not None:
            self.ticket.progress(t.tokens, now)

    def relayed(self, n: int) -> None:
        """``n`` tokens the relay passed through (already in ``token_ids``): timed and reported."""
        t = self.t
        t.tokens += n
        t.relayed += n
        now = t.last_token = time.perf_counter()
        if self.ticket is not None:
            self.ticket.progress(t.tokens, now)
