"""The connector's logger, visible in the vLLM server log (vLLM configures only its own loggers)."""

from __future__ import annotations

import logging


def connector_log() -> logging.Logger:
    """``pdserve.vllm.connector``, with a ``[pdserve]`` stderr handler added once."""
    log = logging.getLogger("pdserve.vllm.connector")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [pdserve] %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
