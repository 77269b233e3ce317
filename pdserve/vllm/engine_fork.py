"""A vLLM server forked by pdserve's warm starter (:mod:`pdserve.launch.warm_start`) forks its engine core from itself.

vLLM's OpenAI server runs its engine core in a child process. Its CLI asks for ``spawn`` (a new interpreter, which
imports torch and vLLM again: ~15 s of a ~25 s start on 2 cores), and vLLM's CPU platform sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` again while it checks the config (vllm/platforms/cpu.py,
``check_and_update_config``). vLLM used as a library forks (its default method). A warm-started server has
already imported everything and has run no torch operation before its engine core starts, so the warm child
sets the method back to ``fork`` right after that check. Only warm-started servers do this (the tests);
``pdserve serve`` without ``PDSERVE_WARM_START=1`` runs vLLM exactly as its CLI does.
"""

from __future__ import annotations

import os
from typing import Any


def fork_engine_core() -> None:
    """Make this process's vLLM server fork its engine core (call before the server reads its config)."""
    from vllm.platforms.cpu import CpuPlatform

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # the CLI's own default would be spawn

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]
