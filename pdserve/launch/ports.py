"""Free TCP ports for the processes a launch (or a test) starts, chosen *below* the kernel's ephemeral range.

A port is picked now and bound later, by a child that takes tens of seconds to start (a vLLM worker). Any
process that meanwhile binds port 0 (the pool node's transfer listener, vLLM's own ZMQ sockets, every client
connection's local end) gets a port from the ephemeral range (``net.ipv4.ip_local_port_range``), so a picked port
inside that range can be taken before its owner binds it. Ports below the range are never handed out that way:
only another picker that chose the same number could take it."""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000  # below this, well-known services cluster
SPAN = 16_384  # how far below the ephemeral range to look


def ephemeral_range(path: Path = RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def picking_range(path: Path = RANGE_FILE) -> range:
    """Where :func:`free_ports` looks: up to ``SPAN`` ports just below the ephemeral range, none under ``LOWEST``
    (empty when the ephemeral range starts too low: then the kernel picks)."""
    lo = ephemeral_range(path)[0]
    return range(max(LOWEST, lo - SPAN), lo)


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int, host: str = "127.0.0.1", exclude: Sequence[int] = ()) -> list[int]:
    """``n`` distinct free TCP ports on ``host``, below the ephemeral range when it leaves room (module doc). All
    stay bound until every port is chosen. Another picker may still choose the same port before the child binds
    it; the health wait then reports the child's bind error."""
    candidates = list(picking_range())
    random.shuffle(candidates)
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for port in candidates:
            if len(ports) == n:
                break
            if port not in exclude and (s := _bound(host, port)) is not None:
                socks.append(s)
                ports.append(port)
        while len(ports) < n:  # no room below the ephemeral range: the kernel's choice
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in exclude and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def _bound(host: str, port: int) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s
