"""A child's death signal (Linux ``PR_SET_PDEATHSIG``): the kernel SIGKILLs the child when the thread that forked it
dies, even after ``kill -9`` of that parent. One place for the libc call, used by :mod:`.procs` (between fork
and exec) and :mod:`.warm_start` (in a forked child). Keep it tiny: it runs in a freshly forked process."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover
        return None


LIBC = _libc()  # the C library, loaded once (a forked child must not load it between fork and exec)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies; exit at once when ``parent_pid`` is already gone (it died before
    the call took effect, so the signal would never come)."""
    if LIBC is not None:
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
