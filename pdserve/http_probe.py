"""One HTTP probe of a process: its status, and which process answered.

Router replicas share one port (``SO_REUSEPORT``), so a probe of that port reaches any of them; each answers its
``/health`` with its pid in :data:`PID_HEADER`, and the launcher counts a replica ready only once that replica
itself has answered 200.
"""

from __future__ import annotations

import urllib.error
import urllib.request

PID_HEADER = "X-Pdserve-Pid"  # which process answered a health probe: router replicas share one port


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """HTTP status of GET ``url``, or None if nothing answers."""
    return http_answer(url, timeout_s)[0]


def http_answer(url: str, timeout_s: float = 2.0) -> tuple[int | None, int | None]:
    """HTTP status of GET ``url`` (None if nothing answers) and the pid of the process that answered, from its
    :data:`PID_HEADER` (None without one)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, _pid(r.headers.get(PID_HEADER))
    except urllib.error.HTTPError as e:
        return e.code, _pid(e.headers.get(PID_HEADER))
    except (urllib.error.URLError, OSError, ValueError):
        return None, None


def _pid(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None
