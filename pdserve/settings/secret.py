"""The shared secret every transfer engine, connector and pool process of a deployment proves (HMAC): where it
comes from and its one rule. The launcher generates it per launch and passes it in :data:`SECRET_ENV` (never on a
command line); the chart puts it in a Kubernetes Secret."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

SECRET_ENV = "PDSERVE_TRANSFER_SECRET"
MIN_SECRET_LEN = 16


def shared_secret(given: Any, who: str, how: str, env: Mapping[str, str] | None = None) -> str:
    """``given``, else :data:`SECRET_ENV` from ``env`` (the process's environment by default), checked: a
    :class:`ConfigError` naming ``who`` needs it and ``how`` to set it when it is not a string of at least
    :data:`MIN_SECRET_LEN` characters."""
    secret = given or (os.environ if env is None else env).get(SECRET_ENV, "")
    if not isinstance(secret, str) or len(secret) < MIN_SECRET_LEN:
        raise ConfigError(f"{who} needs a shared transfer secret of at least {MIN_SECRET_LEN} characters, the "
                          f"same on every process: {how} or set {SECRET_ENV}")
    return secret
