"""How a failed worker call reads for one request (:func:`classify`, the one rule every attempt uses: prefill,
decode, a whole request, ``n > 1``, ``prompt_logprobs``, tools, moves): retried elsewhere (the worker never accepted
it), migrated (it accepted it and then went away, went silent or answered a server error) or the client's error.

A worker's refusal (a 4xx answer, or a 4xx error event in its stream: :func:`refusal`) is the request's own fault:
another worker would refuse it too, so it is never retried or migrated, on any attempt of the run. The client gets
it as vLLM wrote it (status, type, message, ``param``, ``code``; no worker address), before any output as its
answer, after output as the stream's error event, as one vLLM worker ends a stream it refuses."""

from __future__ import annotations

from typing import Union

from ..errors import RouterError, from_worker, refusal_status, upstream_failed
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
    - refused (a 4xx, answered or as an error event, :func:`refusal`): the worker's refusal, as it wrote it;
    - accepted and then gone, silent, a 5xx or an error event that is not a 4xx: :class:`Migrate` what is left;
    - anything else (a malformed answer): 502 before any output, else a mid-request failure."""
    if e.kind in RETRYABLE and not started:
        return Retry(e.url, e.dead, str(e))
    refused = refusal(e)
    if refused is not None:
        return refused
    if migratable(e):
        return Migrate(e.url, role, str(e))
    if not mid_request:
        return as_router_error(e)
    return upstream_failed(f"{role} worker {e.url} failed mid-request: {e}")


def refusal(e: WorkerError) -> RouterError | None:
    """The worker's refusal of the request itself (a 4xx answer, or a vLLM error event whose ``code`` is a 4xx) as
    the client's error, in the worker's own status, type, message, ``param`` and ``code``; None for any other
    failure."""
    if e.kind == "http" and e.status is not None and 400 <= e.status < 500:
        return from_worker(e.status, e.payload)
    if e.kind == "stream_error":
        status = refusal_status(e.payload)
        if status is not None:
            return from_worker(status, e.payload, event=True)
    return None


def migratable(e: WorkerError) -> bool:
    """The worker accepted the request and then failed in a way another worker may not: it went away, went
    silent, or answered a server error. A 4xx (the request itself) is not retried."""
    if e.kind in MIGRATABLE:
        return True
    if e.kind == "http":
        return e.status is not None and e.status >= 500
    if e.kind == "stream_error":
        return refusal_status(e.payload) is None
    return False


def as_router_error(e: WorkerError) -> RouterError:
    """The client's error for a worker failure before anything was sent: a refusal as the worker wrote it, else 502."""
    refused = refusal(e)
    if refused is not None:
        return refused
    if e.kind == "http" and e.status is not None:
        return from_worker(e.status, e.payload)
    return upstream_failed(str(e))
