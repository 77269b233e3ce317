"""Shared by the tests of pdserve's vLLM general plugins that wrap a constructor (nixl_progress, nixl_cores): a
stand-in whose constructor starts a thread, and the check that ``register`` wraps only when its variable asks, once."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

import pytest


class ThreadStarter:
    """A constructor that starts one thread (as NIXL's agent starts its progress thread); ``before`` runs first."""

    def __init__(self, before: Callable[[], None] = lambda: None) -> None:
        before()
        self.stop = threading.Event()
        self.tid = 0
        ready = threading.Event()

        def run() -> None:
            self.tid = threading.get_native_id()
            ready.set()
            self.stop.wait(10)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(5)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(5)


def check_register(monkeypatch: Any, register: Callable[[], None], env: str, value: str, module: str, cls: str,
                   marker: str) -> None:
    """``register()`` wraps ``module.cls.__init__`` (marked ``marker``) only with ``env=value``, and only once; the
    real class is restored after the test. Skips where the module cannot be imported."""
    try:
        target = getattr(importlib.import_module(module), cls)
    except Exception:
        target = None
    if target is not None:
        monkeypatch.setattr(target, "__init__", target.__init__)
    monkeypatch.delenv(env, raising=False)
    register()  # no variable: nothing wrapped
    assert target is None or not getattr(target.__init__, marker, False)
    monkeypatch.setenv(env, value)
    register()
    if target is None:
        pytest.skip(f"{module} is not importable here")
    assert getattr(target.__init__, marker, False)
    wrapped = target.__init__
    register()  # twice: wrapped once
    assert target.__init__ is wrapped
