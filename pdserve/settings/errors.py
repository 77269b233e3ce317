"""The one configuration error class: every config of pdserve raises it or a subclass named after its process
(:class:`pdserve.router.config.RouterConfigError`, :class:`pdserve.conductor.config.ConductorConfigError`,
:class:`pdserve.store.config.StoreConfigError`, :class:`pdserve.transfer.config.TransferConfigError`,
:class:`pdserve.kube.discovery.DiscoveryConfigError`, :class:`pdserve.kube.drain.DrainConfigError`,
:class:`pdserve.plan.kvsize.ModelConfigError`), so ``except ConfigError`` catches them all, and every command
prints one the same way (:func:`config_fault`)."""

from __future__ import annotations

import sys


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which and how to fix it."""


def config_fault(command: str, e: ConfigError) -> int:
    """Print a config fault as every pdserve command does (``<command>: config error: <message>`` on stderr) and
    return the exit status for it, 2."""
    print(f"{command}: config error: {e}", file=sys.stderr)
    return 2
