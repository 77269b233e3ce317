"""Rules across settings that the launcher, the router and the conductor share: one check, one message."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError


def check_slo_needs_conductor(value: Any, label: str, policy: str, error: type[Exception] = ConfigError) -> None:
    """A target is only meaningful with the conductor policy (the baselines neither predict nor reject)."""
    if value is not None and policy != "conductor":
        raise error(f"{label} needs policy=conductor (only the conductor predicts and rejects); policy is {policy!r}")


def check_host_port(value: Any, label: str, what: str, error: type[Exception] = ConfigError, sep: str = "=") -> None:
    """``value`` is ``HOST:PORT`` with a port 1-65535, or empty (none); ``what`` says what to give."""
    if not value:
        return
    host, colon, port = str(value).rpartition(":")
    if not isinstance(value, str) or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise error(f"{label}{sep}{value!r}: give {what}")
