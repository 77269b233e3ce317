"""The one table of pdserve's settings and what is made from it.

Each setting is declared once in :mod:`.table` (name, type, unit, default, range or choices, help, and which
processes get it: launcher, router, conductor, worker, pool). From it come the configs' defaults and checks
(:meth:`Setting.check`, :func:`check_fields`), the command-line flags of ``pdserve serve`` and ``python -m
pdserve.router`` (:mod:`.flags`), the router flags the launcher writes (:mod:`.argv`), the values the router
hands to the conductor with their units converted (:mod:`.targets`) and the docs' option tables
(:mod:`.docs`). :mod:`.connector` parses pdserve's connector settings (``kv_connector_extra_config``).

This package is the bottom layer: it imports nothing else of pdserve (``tests/unit/test_architecture.py``).
"""

from .errors import ConfigError
from .rules import check_slo_needs_conductor
from .spec import Setting, Target, check_fields, write_resolved
from .table import DTYPES, KV_CONNECTORS, POLICIES, SETTINGS, default, of, setting

__all__ = ["DTYPES", "KV_CONNECTORS", "POLICIES", "SETTINGS", "ConfigError", "Setting", "Target", "check_fields",
           "check_slo_needs_conductor", "default", "of", "setting", "write_resolved"]
