"""One request's placement, from the decision to its release: the only thing the hand-off talks to.

:meth:`ConductorPlacement.choose <pdserve.router.fleet.placement.ConductorPlacement.choose>` returns a
:class:`PlacementTicket`; the hand-off reports the prompt computed (:meth:`~PlacementTicket.prefill_done`), output
tokens (:meth:`~PlacementTicket.progress`), moves the decode when D fails before answering
(:meth:`~PlacementTicket.replace_decode`: same P, another D) and ends it with :meth:`~PlacementTicket.close`
exactly once, whatever happened (success, error, client disconnect); a second close, and any report after the
close, do nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...conductor import Conductor, Decision
from ...conductor.policy import NoWorker
from ...conductor.refusal_replay import RefusalReplay
from ..errors import unavailable
from ..workers.client import Worker
from .decision_log import DecisionLog
from .prediction_error import Measured, PredictionErrors

if TYPE_CHECKING:
    from .registry import WorkerRegistry


PROGRESS_EVERY_TOKENS = 16  # report decode progress at least every this many tokens of a ticket ...
PROGRESS_EVERY_S = 0.25  # ... or once this long has passed since the last report (and always at close)


class PlacementTicket:
    """Where one request runs. ``decode`` is always set; ``prefill`` None means the whole request runs on
    ``decode`` (colocated or decode-local)."""

    # moves (pdserve.router.fleet.move): a move's ticket sets ``handed`` when its tail prefill is done (or the ticket
    # closes); the ticket of the prefill that caused the moves waits on theirs (``waits``), at most ``wait_s``
    handed: asyncio.Event | None = None
    waits: tuple[PlacementTicket, ...] = ()
    wait_s = 0.0
    errors: PredictionErrors | None = None  # where close() reports the predictions' error (the router's metrics) ...
    decisions: DecisionLog | None = None  # ... and the placement, for the request's decision record
    refusals: RefusalReplay | None = None  # ... and its measured TTFT / TPOT, to judge the rejections beside it
    excluded: frozenset[str] = frozenset()  # the workers the placement left out (failed or slow in an earlier round)
    caused_by = ""  # a move's: the request whose placement caused it ...
    cause: object = None  # ... and, when that request is traced, its placement span's context (the move's link)

    def __init__(self, conductor: Conductor, registry: WorkerRegistry, decision: Decision,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        assert decision.decode is not None
        self._conductor = conductor
        self._registry = registry
        self.decision = decision
        self.request_id = decision.request_id
        self.prefill: Worker | None = registry[decision.prefill] if decision.prefill else None
        self.decode: Worker = registry[decision.decode]
        self.closed = False
        self._prefilled = False
        self.tokens_before = 0  # output tokens streamed before this ticket (a migrated request's earlier workers)
        self._pending = 0  # this ticket's tokens known to the router ...
        self._reported = 0  # ... and told to the conductor
        self._reported_at = 0.0  # perf_counter of the last report
        self._clock = clock  # the same clock as progress's ``now`` (perf_counter)
        self._placed_at = clock()  # the decision: the conductor's predictions start here
        self._first: tuple[float, int] | None = None  # (when, own tokens) at this ticket's first token ...
        self._last: tuple[float, int] | None = None  # ... and at its latest

    def prefill_done(self) -> None:
        """The prompt is computed (P answered, or a whole request's first token arrived); once."""
        if self.closed or self._prefilled:
            return
        self._prefilled = True
        self._conductor.prefill_done(self.request_id)
        if self.handed is not None:
            self.handed.set()

    @property
    def prefilled(self) -> bool:
        return self._prefilled

    def progress(self, tokens: int, now: float | None = None) -> None:
        """``tokens`` output tokens of the request so far, the first included; the conductor hears those of this
        ticket only (a migrated request's earlier tokens were another placement's).

        Coalesced: the ticket's first two tokens are reported at once (they time the hand-off and start the decode
        step clock), then at most one report per :data:`PROGRESS_EVERY_TOKENS` tokens or
        :data:`PROGRESS_EVERY_S` seconds (``now``: the caller's perf_counter, read when omitted), and the rest at
        :meth:`close`. The conductor divides a step time by the tokens reported, so its estimates stay per token,
        while the router no longer calls it on every streamed token."""
        if self.closed or tokens <= self.tokens_before:
            return
        own = tokens - self.tokens_before
        self._pending = own
        if now is None:
            now = self._clock()
        self._last = (now, own)
        if self._first is None:
            self._first = self._last
        if own <= 2 or own - self._reported >= PROGRESS_EVERY_TOKENS:
            self._report(now)
            return
        if now - self._reported_at >= PROGRESS_EVERY_S:
            self._report(now)

    def _report(self, now: float) -> None:
        if self._pending > self._reported:
            self._reported = self._pending
            self._reported_at = now
            self._conductor.decode_progress(self.request_id, self._pending)

    def measured(self) -> Measured:
        """This placement's TTFT (decision to first token) and TPOT (over its later tokens), as far as they came."""
        if self._first is None or self._last is None:
            return Measured(None, None)
        (t0, n0), (t1, n1) = self._first, self._last
        return Measured(t0 - self._placed_at, (t1 - t0) / (n1 - n0) if n1 > n0 else None)

    def replace_decode(self, exclude: frozenset[str] = frozenset()) -> Worker:
        """D failed before it accepted the decode: place the decode again (P, its KV lease and its prefill report
        stay as they are) on another decode worker not in ``exclude``; raises a 503 RouterError when none is
        left. Returns the new D (also ``self.decode``)."""
        if self.closed:
            raise RuntimeError(f"ticket {self.request_id} is closed")
        try:
            url = self._conductor.replace_decode(self.request_id, exclude)
        except NoWorker:
            raise unavailable(f"no healthy decode worker left for the hand-off (tried {self.decode.url}"
                              f"{', ' + ', '.join(sorted(exclude)) if exclude else ''})") from None
        self.decode = self._registry[url]
        return self.decode

    def close(self) -> None:
        """Release everything reserved for the request; only the first call does anything."""
        if self.closed:
            return
        self._report(self._clock())  # tokens a coalesced progress report still held
        self.closed = True
        self._conductor.finished(self.request_id)
        self._observe()
        if self.handed is not None:
            self.handed.set()

    def hand_over(self) -> None:
        """The request's placement was replaced by a move's (the conductor already released this one): report the
        tokens still held, then end this ticket without releasing anything."""
        if self.closed:
            return
        self._report(self._clock())
        self.closed = True
        self._observe()

    def _observe(self) -> None:
        measured = self.measured()
        if measured.ttft_s is not None:  # the conductor's correction factors learn from the error
            self._conductor.recalibrate(self.decision, measured.ttft_s, measured.tpot_s)
        if self.refusals is not None:
            self.refusals.closed(self.request_id, measured.ttft_s, measured.tpot_s)
        if self.errors is None and self.decisions is None:
            return
        policy = self._conductor.config.policy
        if self.errors is not None:
            self.errors.observe(self.decision, policy, measured)
        if self.decisions is not None:
            self.decisions.closed(self.request_id, policy, self.decision, self.excluded, measured,
                                  moved=self.handed is not None)
