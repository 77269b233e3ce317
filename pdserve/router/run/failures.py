"""How a failed worker call reads for one request (:func:`classify`, the one rule every attempt uses: prefill,
decode, a whole request, ``n > 1``, ``prompt_logprobs``, tools, moves): retried elsewhere (the worker never accepted
it), migrated (it accepted it and then went away, went silent or answered a server error) or the client's error."""

from __future__ import annotations

from typing import Union

from ..errors import RouterError, from_worker, upstream_failed
from ..workers.client import WorkerError

RETRYABLE = ("connect",)  # the worker never accepted the request: safe to try another one
MIGRATABLE = ("closed", "timeout")  # the worker accepted it and then went away (or went silent)


class Retry(Exception):
    """The worker never accepted the request (``dead``: it refused the connection; else it was too slow to)."""

    def __init__(self, url: str, dead: bool = True, reason: str = "") -> None:
        super().__init__(url)
        self.url = url
        self.dead = dead
        self.reason = reason


class Migrate(Exception):
    """The worker took the request and then failed: run what is left of it elsewhere."""

    def __init__(self, url: str, role: str, reason: str) -> None:
        super().__init__(url)
        self.url = url
        self.role = role
        self.reason = reason


Outcome = Union[Retry, Migrate, RouterError]  # noqa: UP007 (a runtime alias)


def classify(e: WorkerError, role: str, started: bool, mid_request: bool) -> Outcome:
    """What a failed call of ``role`` to ``e.url`` means for the request. ``started``: the worker had answered it
    (a streamed token, an answer's head); ``mid_request``: the client already has output of this request, so an
    error it gets now is a mid-request one.

    - never accepted (``connect``, before any answer): :class:`Retry` elsewhere; ``dead`` only on evidence of death
      (a refused connection), so a worker that was merely slow is not taken out;
    - accepted and then gone, silent, a 5xx or an error event that is not a 4xx: :class:`Migrate` what is left;
    - anything else (a 4xx: the request itself): the client's error, the worker's own status before any output."""
    if e.kind in RETRYABLE and not started:
        return Retry(e.url, e.dead, str(e))
    if migratable(e):
        return Migrate(e.url, role, str(e))
    if not mid_request:
        return as_router_error(e)
    return upstream_failed(f"{role} worker {e.url} failed mid-request: {e}")


def migratable(e: WorkerError) -> bool:
    """The worker accepted the request and then failed in a way another worker may not: it went away, went
    silent, or answered a server error. A 4xx (the request itself) is not retried."""
    if e.kind in MIGRATABLE:
        return True
    if e.kind == "http":
        return e.status is not None and e.status >= 500
    if e.kind == "stream_error":
        err = e.payload.get("error") if isinstance(e.payload, dict) else None
        code = err.get("code") if isinstance(err, dict) else None
        return not (isinstance(code, int) and 400 <= code < 500)
    return False


def as_router_error(e: WorkerError) -> RouterError:
    """The client's error for a worker failure before anything was sent: the worker's own HTTP status, else 502."""
    if e.kind == "http" and e.status is not None:
        return from_worker(e.status, e.payload)
    return upstream_failed(str(e))
