"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status.

The router's own refusals take vLLM's error types (``BadRequestError`` for a 400, ``NotFoundError`` for a 404), so
a client reads the same ``type`` whether the router or a worker refused the body; a worker's refusal
(:func:`from_worker`) is passed on as vLLM wrote it: its status, type, message, ``param`` and integer ``code``."""

from __future__ import annotations

from typing import Any


class RouterError(Exception):
    """An error the client sees. ``status`` is the HTTP status; the rest fills OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None, headers: dict[str, str] | None = None,
                 event: bool = False) -> None:
        super().__init__(message)
        # a worker refused the request inside its 200 stream (vLLM's error event): a streamed answer that has sent
        # nothing yet refuses it the same way (200, the event, [DONE]), as one vLLM worker does
        self.event = event
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's error object; without a code of its own, ``code`` is the HTTP status, as vLLM's."""
        code = self.status if self.code is None else self.code
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": code}}


def model_param(field: str) -> str:
    """How vLLM 0.32 names a field its request model refuses (a pydantic type, ``Literal`` or ``Field(ge=...)``):
    FastAPI's error location, ``body.<field>`` (vLLM's ``clean_loc_for_param``). A refusal vLLM makes in its own
    checks (``VLLMValidationError``, ``SamplingParams``) names the field alone."""
    return f"body.{field}"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RouterError:
    return RouterError(400, message, "BadRequestError", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> RouterError:
    return RouterError(404, message, "NotFoundError", param, code)


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


def from_worker(status: int, payload: Any, event: bool = False) -> RouterError:
    """A worker's own error response: a 4xx (the request's own fault: ``run.failures.refusal``) passed on as
    the worker wrote it (its status, message, type, ``param`` and ``code``: vLLM's is the status as an integer), a
    5xx or garbage as 502. ``event``: it came as an error event of the worker's 200 stream."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or "worker error")
        etype = str(err.get("type") or "BadRequestError")
        param = err.get("param")
        code = err.get("code")
    elif isinstance(payload, dict) and "message" in payload:  # older vLLM: top-level ErrorResponse
        message, etype = str(payload["message"]), str(payload.get("type") or "BadRequestError")
        param, code = payload.get("param"), payload.get("code")
    else:
        message, etype, param, code = f"worker answered HTTP {status}: {str(payload)[:500]}", "server_error", None, None
    if 400 <= status < 500:  # what the router let through, the worker's engine refused: inside a vLLM stream
        return RouterError(status, message, etype, param if isinstance(param, str) else None,
                           code if isinstance(code, (str, int)) and not isinstance(code, bool) else None,
                           event=event)
    return RouterError(502, f"worker failed (HTTP {status}): {message}", "server_error", None, "worker_failed")


def refusal_status(payload: Any) -> int | None:
    """The status of a vLLM error event's (``{"error": {..., "code": 400}}``) refusal: its 4xx code, else None (a
    server error, or no status)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500 else None
