"""The launcher configs' shared error and field checks (imported by :mod:`pdserve.config` and
:mod:`pdserve.config_devices`, which :mod:`pdserve.config` itself uses)."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which and how to fix it."""


def check_port(name: str, port: Any) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"{name}={port!r}: use a TCP port 1-65535, or 0 to pick a free one")
