"""One request's placement, from the decision to its release: the only thing the hand-off talks to.

:meth:`ConductorPlacement.choose <pdserve.router.placement.ConductorPlacement.choose>` returns a
:class:`PlacementTicket`; the hand-off reports the prompt computed (:meth:`~PlacementTicket.prefill_done`), output
tokens (:meth:`~PlacementTicket.progress`), moves the decode when D fails before answering
(:meth:`~PlacementTicket.replace_decode`: same P, another D) and ends it with :meth:`~PlacementTicket.close`
exactly once, whatever happened (success, error, client disconnect); a second close, and any report after the
close, do nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..conductor import Conductor, Decision
from ..conductor.policy import NoWorker
from .errors import unavailable
from .workers import Worker

if TYPE_CHECKING:
    from .registry import WorkerRegistry


class PlacementTicket:
    """Where one request runs. ``decode`` is always set; ``prefill`` None means the whole request runs on
    ``decode`` (colocated or decode-local)."""

    def __init__(self, conductor: Conductor, registry: WorkerRegistry, decision: Decision) -> None:
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

    def prefill_done(self) -> None:
        """The prompt is computed (P answered, or a whole request's first token arrived); once."""
        if self.closed or self._prefilled:
            return
        self._prefilled = True
        self._conductor.prefill_done(self.request_id)

    def progress(self, tokens: int) -> None:
        """``tokens`` output tokens of the request so far, the first included; the conductor hears those of this
        ticket only (a migrated request's earlier tokens were another placement's)."""
        if not self.closed and tokens > self.tokens_before:
            self._conductor.decode_progress(self.request_id, tokens - self.tokens_before)

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
        self.closed = True
        self._conductor.finished(self.request_id)
