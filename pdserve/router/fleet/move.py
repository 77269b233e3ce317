"""Voluntary moves of running decodes: the router's side of :mod:`pdserve.conductor.moves`.

After each elastic placement :meth:`~pdserve.router.fleet.placement.ConductorPlacement.choose` asks the conductor which
decodes running on the prefilling worker should move (:func:`move_off`). For each, the request's
:class:`~pdserve.router.run.generation.Generation` (found in :class:`Movers`, where every running generation is listed
by request id) gets the move's ticket (P = the old worker for the tail, D = the new one): it stops reading the
old worker's stream at once (closing it: vLLM aborts the request there), and its next attempt runs that ticket
as a P -> D hand-off of ``prompt + every streamed token`` (the old worker's prefix cache holds all but the last
partial block; the new worker reads the KV through the connector), so the client sees one stream and greedy
output stays exact. Unlike a failure's migration this is not counted against ``--migration-limit`` nor as a
worker error; ``pdserve_router_moves_total`` and ``pdserve_router_move_gap_seconds`` (from the stop on the old
worker to the first token after the move) measure it.

The prefill that caused the moves waits (at most ``MoveConfig.wait_s``) until each move's tail prefill is done
(:func:`wait_moves`), so that the old worker does not queue those small prefills behind the long one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from ...conductor import Conductor
from ...conductor.moves import MoveConfig, plan_moves

if TYPE_CHECKING:
    from .registry import WorkerRegistry
    from .ticket import PlacementTicket

log = logging.getLogger("pdserve.router")

class Moved(Exception):
    """Control flow: the generation's current attempt ends here and continues on its move ticket."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.url = url


class Movable(Protocol):
    def movable_from(self, url: str) -> bool: ...

    def request_move(self, ticket: PlacementTicket) -> bool: ...


class Movers:
    """The running generations by request id (the conductor's request ids): who to tell when a decode moves."""

    def __init__(self) -> None:
        self._by_id: dict[str, Movable] = {}

    def add(self, request_id: str, gen: Movable) -> None:
        self._by_id[request_id] = gen

    def remove(self, request_id: str, gen: Movable) -> None:
        if self._by_id.get(request_id) is gen:
            del self._by_id[request_id]

    def get(self, request_id: str) -> Movable | None:
        return self._by_id.get(request_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)


def move_off(conductor: Conductor, registry: WorkerRegistry, movers: Movers, config: MoveConfig,
             request_id: str) -> list[PlacementTicket]:
    """Move the decodes that pay off the worker that prefills ``request_id`` (just placed); returns the moves'
    tickets, each already handed to its generation."""
    from .ticket import PlacementTicket

    def can_move(rid: str, src: str) -> bool:
        gen = movers.get(rid)
        return gen is not None and gen.movable_from(src)

    tickets = []
    for m in plan_moves(conductor, request_id, config, can_move):
        gen = movers.get(m.request_id)
        assert gen is not None
        decision = conductor.decision_of(m.request_id)  # the move's split, recorded by plan_moves
        assert decision is not None
        ticket = PlacementTicket(conductor, registry, decision)
        ticket.handed = asyncio.Event()
        if not gen.request_move(ticket):  # cannot happen after can_move (same loop turn); never strand a placement
            ticket.close()
            continue
        log.info("request %s: %s", m.request_id, m.reason)
        tickets.append(ticket)
    return tickets


async def wait_moves(tickets: Sequence[PlacementTicket], timeout_s: float) -> float:
    """Wait until every move ticket's tail prefill is done (or its ticket closed), at most ``timeout_s``; returns
    the seconds waited."""
    events = [t.handed for t in tickets if t.handed is not None and not t.handed.is_set()]
    if not events:
        return 0.0
    t0 = time.perf_counter()
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s)
    finally:
        for w in waiters:
            w.cancel()
    return time.perf_counter() - t0


class MoveSubject(Protocol):
    """What :class:`MovableRun` reads of its request's run (:class:`~pdserve.router.run.generation.Generation`)."""

    @property
    def ticket(self) -> PlacementTicket | None: ...

    def decoding(self) -> bool:
        """The run streams tokens from its ticket's decode worker (prompt computed, no hand-off pending, not
        finished), as one of a P -> D pair's decodes (not colocated, P's first token streamed)."""
        ...

    def tokens_left(self) -> int: ...

    def interrupt(self, reason: str) -> bool:
        """Stop the run's await on its worker (see ``Attempt.interrupt``)."""
        ...


class MovableRun:
    """A request's part in moves, owned by its run: whether its decode can move off a worker now
    (:meth:`movable_from`), and a move's ticket (``pending``) from :meth:`request_move` until the run's next
    attempt takes it (:meth:`take`) or the request ends (:meth:`release`)."""

    def __init__(self, run: MoveSubject) -> None:
        self.run = run
        self.pending: PlacementTicket | None = None
        self.at: float | None = None  # perf_counter of the stop on the old worker (a move's gap starts there)

    def movable_from(self, url: str) -> bool:
        """True while the request decodes on ``url`` (its prompt computed, its tokens streaming from there) with at
        least two tokens left."""
        t = self.run.ticket
        return (self.pending is None and t is not None and not t.closed and t.decode.url == url and t.prefilled
                and self.run.decoding() and self.run.tokens_left() >= 2)

    def request_move(self, ticket: PlacementTicket) -> bool:
        """Take ``ticket`` (P = the old worker, D = the new one) as the next attempt's: the current ticket is handed
        over (the conductor already holds the new placement) and the run's await on the old worker's stream is
        interrupted (the attempt then ends with :class:`Moved`, which closes the stream: vLLM aborts the request);
        when the run is not awaiting the worker right now (writing to the client), before its next await."""
        src = ticket.prefill.url if ticket.prefill is not None else ""
        current = self.run.ticket
        if not self.movable_from(src) or current is None:
            return False
        current.hand_over()
        self.pending = ticket
        self.at = time.perf_counter()
        self.run.interrupt("move")
        return True

    def moved(self) -> Moved:
        """The exception that ends the interrupted attempt."""
        t = self.pending
        return Moved(t.prefill.url if t is not None and t.prefill is not None else "")

    def take(self) -> PlacementTicket | None:
        """The move's ticket for the run's next attempt (None without a move)."""
        ticket, self.pending = self.pending, None
        return ticket

    def release(self) -> None:
        """The request ended before it took the move (a move that came too late): close the move's ticket."""
        if self.pending is not None:
            self.pending.close()
            self.pending = None
