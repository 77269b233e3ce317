"""The one configuration error class: every config of pdserve raises it or a subclass named after its process
(:class:`pdserve.router.config.RouterConfigError`, :class:`pdserve.conductor.config.ConductorConfigError`,
:class:`pdserve.store.config.StoreConfigError`), so ``except ConfigError`` catches them all."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which and how to fix it."""
