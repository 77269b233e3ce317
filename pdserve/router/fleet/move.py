"""Voluntary moves of running decodes (issue 16, item 1): the router's side of :mod:`pdserve.conductor.moves`.

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

POKE_S, POKE_TRIES = 0.002, 2500  # a move waits up to 5 s for the run to await the old worker's stream again


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


class MovableRun:
    """What a :class:`~pdserve.router.run.generation.Generation` adds for moves: whether its decode can move off a
    worker now, and taking a move's ticket (the run's next attempt uses it)."""

    # set by Generation.__init__ (class defaults keep partly built generations in unit tests working)
    ticket: PlacementTicket | None = None
    colocated = False
    first_from_prefill = True
    finish_reason: str | None = None
    max_tokens = 0
    token_ids: list[int]
    _moving: PlacementTicket | None = None  # the move's ticket, until the run's next attempt takes it
    _move_at: float | None = None  # perf_counter of the stop on the old worker, until the first token after it
    _waiter: asyncio.Task | None = None
    _handoff_since: float | None = None
    _cancelled = False

    def movable_from(self, url: str) -> bool:
        """True while the request decodes on ``url`` (its prompt computed, its tokens streaming from there) with at
        least two tokens left."""
        t = self.ticket
        return (self._moving is None and not self.colocated and self.first_from_prefill and t is not None
                and not t.closed and t.decode.url == url and t.prefilled and self._handoff_since is None
                and self.finish_reason is None and self.max_tokens - len(self.token_ids) >= 2)

    def request_move(self, ticket: PlacementTicket) -> bool:
        """Take ``ticket`` (P = the old worker, D = the new one) as the next attempt's: the current ticket is handed
        over (the conductor already holds the new placement) and the await on the old worker's stream cancelled
        (``Generation._next`` turns that into :class:`Moved`, which closes the stream: vLLM aborts the request);
        when the run is not awaiting the worker right now (writing to the client), as soon as it is."""
        src = ticket.prefill.url if ticket.prefill is not None else ""
        if not self.movable_from(src) or self.ticket is None:
            return False
        self.ticket.hand_over()
        self._moving = ticket
        self._move_at = time.perf_counter()
        self._poke_move(ticket, POKE_TRIES)
        return True

    def _poke_move(self, ticket: PlacementTicket, tries: int) -> None:
        if self._moving is not ticket:
            return  # taken (the run's next attempt runs it) or released (the request ended)
        if self._waiter is not None:
            self._cancelled = True
            self._waiter.cancel()
        elif tries > 0:  # the run checks _moving in its next _next; the relay needs the cancel: try again soon
            asyncio.get_running_loop().call_later(POKE_S, self._poke_move, ticket, tries - 1)
