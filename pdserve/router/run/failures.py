"""How a failed worker call reads for one request: retried elsewhere (the worker never accepted it), migrated (it
accepted it and then went away, went silent or answered a server error) or passed to the client."""

from __future__ import annotations

from ..errors import RouterError, from_worker, upstream_failed
from ..fleet.workers import WorkerError

RETRYABLE = ("connect",)  # the worker never accepted the request: safe to try another one
MIGRATABLE = ("closed", "timeout")  # the worker accepted it and then went away (or went silent)


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


class Retry(Exception):
    """The worker never accepted the request (``dead``: it refused the connection; else it was too slow to)."""

    def __init__(self, url: str, dead: bool = True) -> None:
        super().__init__(url)
        self.url = url
        self.dead = dead


class Migrate(Exception):
    """The worker took the request and then failed: run what is left of it elsewhere."""

    def __init__(self, url: str, role: str, reason: str) -> None:
        super().__init__(url)
        self.url = url
        self.role = role
        self.reason = reason
