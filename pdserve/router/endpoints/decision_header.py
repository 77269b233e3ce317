"""The ``X-Pdserve-Decision`` header: a generation request that sends it gets its decision record in the answer's
header of that name (see :mod:`.decisions`). :class:`~.intake.Intake` keeps the choices of such a request on it;
the app's response hook (added by :mod:`.decisions`) writes the header from them."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from ..fleet.decision_log import decision_fields
from ..run.choices import Choice

DECISION_HEADER = "X-Pdserve-Decision"
HEADER_MAX = 8000  # characters of the header's value (aiohttp's clients read header lines up to 8190 bytes)
# the request id and choices of a request that asked (Intake.start keeps them on the request)
CHOICES_KEY: web.RequestKey[tuple[str, list[Choice]]] = web.RequestKey("pdserve.decision_choices", tuple)
_TRUE = ("1", "true", "yes")


def wants_record(request: web.Request) -> bool:
    """The request asked for its decision record in the answer's headers."""
    return request.headers.get(DECISION_HEADER, "").lower() in _TRUE


def _choice_record(log: Any, choice: Choice) -> dict[str, Any]:
    gen = choice.gen
    rid = gen.req.request_id
    closed = log.record(rid) if log is not None else None
    rec: dict[str, Any] = dict(closed) if closed is not None else {"request_id": rid, "placements": []}
    ticket = gen.ticket
    if ticket is not None and not ticket.closed and getattr(ticket, "decision", None) is not None:
        why = "first" if not rec["placements"] else "migration"
        rec["placements"] = [*rec["placements"], {**decision_fields(ticket.decision), "why": why, "open": True}]
    return rec


def header_value(log: Any, choices: list[Choice], request_id: str) -> str:
    """The header's JSON: one choice's record, or ``{"request_id", "choices": [...]}`` for several."""
    recs = [_choice_record(log, c) for c in choices]
    value: dict[str, Any] = recs[0] if len(recs) == 1 else {"request_id": request_id, "choices": recs}
    text = json.dumps(value, separators=(",", ":"))
    if len(text) > HEADER_MAX:
        for rec in recs:
            for placed in rec["placements"]:
                placed.pop("candidates", None)
        value["truncated"] = True
        text = json.dumps(value, separators=(",", ":"))
    return text
