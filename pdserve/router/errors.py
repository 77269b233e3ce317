"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status."""

from __future__ import annotations

from typing import Any


class RouterError(Exception):
    """An error the client sees. ``status`` is the HTTP status; the rest fills OpenAI's error object.
    ``in_stream``: vLLM refuses it from inside its stream (its engine's checks), so a streamed request gets 200 and
    an error event, as from one vLLM worker (api/stream_refusal.py)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
                 in_stream: bool = False) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.in_stream = in_stream

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RouterError:
    return RouterError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> RouterError:
    return RouterError(404, message, "invalid_request_error", param, code)


def unavailable(message: str, code: str = "no_healthy_worker") -> RouterError:
    return RouterError(503, message, "service_unavailable", None, code)


def upstream_failed(message: str, code: str = "worker_failed") -> RouterError:
    return RouterError(502, message, "server_error", None, code)


def deadline_exceeded(message: str, code: str = "request_timeout") -> RouterError:
    """A deadline passed (the request's or the P -> D hand-off's): 504, or an error event after the first token."""
    return RouterError(504, message, "timeout_error", None, code)


def too_many_requests(message: str, retry_after_s: float, code: str = "too_many_requests") -> RouterError:
    """An in-flight limit is reached: 429 with Retry-After (whole seconds, at least 1)."""
    return RouterError(429, message, "rate_limit_error", None, code,
                       headers={"Retry-After": str(max(1, int(retry_after_s + 0.999)))})


def from_worker(status: int, payload: Any) -> RouterError:
    """A worker's own error response, passed through with its status (4xx) or as 502 (5xx, garbage)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or "worker error")
        etype = str(err.get("type") or "invalid_request_error")
        param = err.get("param")
        code = err.get("code")
    elif isinstance(payload, dict) and "message" in payload:  # older vLLM: top-level ErrorResponse
        message, etype = str(payload["message"]), str(payload.get("type") or "invalid_request_error")
        param, code = payload.get("param"), payload.get("code")
    else:
        message, etype, param, code = f"worker answered HTTP {status}: {str(payload)[:500]}", "server_error", None, None
    if 400 <= status < 500:  # what the router let through, the worker's engine refused: inside a vLLM stream
        return RouterError(status, message, etype, param if isinstance(param, str) else None,
                           code if isinstance(code, str) else None, in_stream=status == 400)
    return RouterError(502, f"worker failed (HTTP {status}): {message}", "server_error", None, "worker_failed")
