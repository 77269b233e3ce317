"""This process's threads, by Linux thread id (``/proc/self/task``): what pdserve's vLLM plugins compare before and
after a constructor to find the threads it started (nixl_progress.py, nixl_cores.py)."""

from __future__ import annotations

import os


def own_threads() -> list[int]:
    """The ids of this process's threads now (empty where ``/proc`` cannot be read)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []
