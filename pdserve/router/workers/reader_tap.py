"""The one place the router reaches under aiohttp's public API: a worker stream's reads handed to a tap in the
socket callback (the relay's inline path, :mod:`..run.relay`).

aiohttp has no public hook for a response body's reads, so :func:`tap` swaps the body reader's class for
:class:`_TappedReader` (aiohttp's own ``StreamReader`` plus a look-up: no slot or state of its own, so the swap is
allowed) and keeps the tap in a table keyed by the reader. :func:`check` runs once when the router's worker session
opens: aiohttp's major version must be 3 and a reader built here must take the swap and hand its reads to a tap
and back. If either fails, :data:`available` stays False, one warning says why, and every relay reads from its task
instead (:meth:`..run.relay.Relay._fill`: the same bytes, slower).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import aiohttp

log = logging.getLogger("pdserve.router")

available = False  # set by check(): the inline tap may be used
_checked = False


class StreamTap(Protocol):
    """Takes a stream's reads in the socket callback."""

    def feed(self, data: bytes) -> bytes:
        """The worker's next bytes; returns those the reader keeps (b"": none, the tap took them all)."""
        ...

    def ended(self) -> bytes:
        """The stream ended or failed while tapped; returns the bytes the reader gets before the end."""
        ...


_TAPS: dict[int, StreamTap] = {}  # id(reader) -> the tap taking its reads (a reader has no slot for it)


def open_taps() -> int:
    """How many streams have a tap now (0 once every relay has handed back)."""
    return len(_TAPS)


class _TappedReader(aiohttp.StreamReader):
    """aiohttp's body reader whose reads go to the stream's tap while it has one; without one, or for what the tap
    gives back, it is aiohttp's reader."""

    __slots__ = ()

    def feed_data(self, data: bytes, *args: Any) -> Any:
        tap = _TAPS.get(id(self))
        if tap is None or not data:
            return super().feed_data(data, *args)
        rest = tap.feed(data)
        return super().feed_data(rest, *args) if rest else False

    def _end_tap(self) -> None:
        tap = _TAPS.pop(id(self), None)
        if tap is not None:
            rest = tap.ended()
            if rest:
                super().feed_data(rest)

    def feed_eof(self) -> None:
        self._end_tap()
        super().feed_eof()

    def set_exception(self, *args: Any, **kw: Any) -> None:
        self._end_tap()
        super().set_exception(*args, **kw)


def can_tap(reader: aiohttp.StreamReader | None) -> bool:
    """True when :func:`tap` may take this reader's reads (the check passed, aiohttp's own reader class); runs the
    check first if the worker session has not."""
    ok = available if _checked else check()
    return ok and reader is not None and type(reader) in (aiohttp.StreamReader, _TappedReader)


def tap(reader: aiohttp.StreamReader, taker: StreamTap) -> None:
    """Hand every read of ``reader`` from now on to ``taker``, until :func:`untap`, the stream's end or failure
    (``taker.ended``)."""
    if type(reader) is aiohttp.StreamReader:
        reader.__class__ = _TappedReader
    _TAPS[id(reader)] = taker


def untap(reader: aiohttp.StreamReader | None) -> bool:
    """Stop handing reads to the tap; False when it had ended already (the stream's end or failure)."""
    return reader is not None and _TAPS.pop(id(reader), None) is not None


class _Probe:
    """The check's tap: keeps what it is fed."""

    def __init__(self) -> None:
        self.fed = b""

    def feed(self, data: bytes) -> bytes:
        self.fed += data
        return b"!"

    def ended(self) -> bytes:
        return b""


class _Protocol:
    """The least a reader asks of its protocol (flow control)."""

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _works() -> str:
    """"" when a reader takes the swap and hands reads to a tap and back; else what failed."""
    major = aiohttp.__version__.split(".")[0]
    if major != "3":
        return f"aiohttp {aiohttp.__version__} is not a 3.x release"
    reader = aiohttp.StreamReader(_Protocol(), 1 << 16, loop=asyncio.get_running_loop())  # type: ignore[arg-type]
    probe = _Probe()
    tap(reader, probe)
    try:
        reader.feed_data(b"abc")
    finally:
        untap(reader)
    reader.feed_data(b"de")
    got = reader.read_nowait()
    if probe.fed != b"abc" or got != b"!de":
        return f"a tapped reader handed {probe.fed!r} to the tap and kept {got!r}"
    return ""


def check() -> bool:
    """Decide once whether the inline tap is used (:data:`available`); logs why not. Call inside the event loop."""
    global available, _checked
    if not _checked:
        _checked = True
        try:
            why = _works()
        except Exception as e:  # aiohttp changed the reader's constructor or slots
            why = f"{type(e).__name__}: {e}"
        available = not why
        if why:
            log.warning("the relay's inline tap is off (%s); relays read from their task instead (slower)", why)
    return available
