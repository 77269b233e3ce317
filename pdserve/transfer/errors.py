"""Errors raised by the transfer engine; each carries a short machine-readable code."""

from __future__ import annotations


class TransferError(Exception):
    """A transfer, registration or connection failed.

    ``code`` is one of: ``bounds`` (a range outside a registered region), ``unknown_region``,
    ``auth`` (bad shared secret), ``peer`` (peer closed, reset or refused), ``deadline``
    (the batch deadline passed), ``aborted``, ``protocol`` (malformed message), ``config``,
    ``unavailable`` (the backend cannot reach this peer).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
