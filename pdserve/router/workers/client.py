"""HTTP clients to the vLLM workers: one-shot completions, SSE streams, health probes.

Every call measures how long the router waited on the worker (``Wait``), so the router's own overhead can be
reported as end-to-end time minus upstream waits. Closing a stream early closes its connection, which makes
vLLM abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from . import reader_tap
from .reader_tap import StreamTap

_JSON = {"Content-Type": "application/json"}


class WorkerError(Exception):
    """A worker call failed. kind: connect (request not accepted) | timeout (silent too long) | http | protocol |
    stream_error | closed."""

    def __init__(self, url: str, kind: str, message: str, status: int | None = None, payload: Any = None,
                 dead: bool = False) -> None:
        super().__init__(f"worker {url}: {message}")
        self.url = url
        self.kind = kind
        self.status = status
        self.payload = payload
        self.dead = dead  # evidence the worker is gone (connection refused), not merely slow


def refused(e: BaseException) -> bool:
    """True when ``e`` says nothing listens at the worker's address any more (its process is gone)."""
    return isinstance(e, aiohttp.ClientConnectorError) and isinstance(e.os_error, ConnectionRefusedError)


@dataclass
class Probe:
    """One /health probe. ``dead``: the worker said it is unhealthy (an HTTP answer other than 200) or refused
    the connection; a probe that timed out or broke off is a failure, not evidence of death."""

    ok: bool
    detail: str
    dead: bool = False


@dataclass
class Wait:
    """Accumulates seconds spent awaiting workers."""

    seconds: float = 0.0


@dataclass
class Worker:
    url: str
    roles: set[str] = field(default_factory=set)
    healthy: bool = True  # optimistic until a probe or a call says otherwise
    last_error: str = ""


class WorkerClient:
    def __init__(self, session: aiohttp.ClientSession, connect_timeout_s: float, idle_timeout_s: float) -> None:
        self.session = session
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s, sock_read=self.idle_timeout_s)

    async def _post(self, url: str, path: str, body: dict, headers: Mapping[str, str] | None = None,
                    idle: bool = True) -> aiohttp.ClientResponse:
        timeout = self._timeout() if idle else aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s)
        try:
            return await self.session.post(url + path, data=json.dumps(body, separators=(",", ":")),
                                           headers=_JSON if headers is None else {**_JSON, **headers},
                                           timeout=timeout)
        except aiohttp.SocketTimeoutError:  # connected and sent, then no answer (a non-streamed call answers at
            # the end): the worker has the request and is silent, it is not a refused connection
            raise WorkerError(url, "timeout", f"no answer for {self.idle_timeout_s} s") from None
        except asyncio.TimeoutError:  # the request was not accepted: safe to send it elsewhere
            raise WorkerError(url, "connect", f"no connection within {self.connect_timeout_s} s") from None
        except aiohttp.ClientConnectorError as e:  # no connection: the request never reached the worker
            raise WorkerError(url, "connect", f"cannot reach: {e}", dead=refused(e)) from None
        except aiohttp.ClientError as e:  # connected, then dropped before the answer: it died with the request
            raise WorkerError(url, "closed", f"connection lost before the answer: {e}") from None

    async def post(self, url: str, path: str, body: dict, headers: Mapping[str, str] | None = None,
                   idle: bool = True) -> aiohttp.ClientResponse:
        """POST ``body`` to ``path`` of the worker at ``url`` and return its answer unread (the caller reads and
        closes it: a relay); raises WorkerError when the worker never answered (``connect``: it never took it).
        ``idle`` False: no idle timeout on the answer (one that says nothing until it is done: the caller bounds
        the whole call)."""
        return await self._post(url, path, body, headers, idle)

    @staticmethod
    async def _error_from(url: str, resp: aiohttp.ClientResponse) -> WorkerError:
        try:
            raw = await resp.read()
            payload: Any = json.loads(raw)
        except Exception:  # not JSON (proxy page, truncated body)
            payload = None
        return WorkerError(url, "http", f"HTTP {resp.status}", resp.status, payload)

    async def complete(self, url: str, body: dict, wait: Wait, headers: Mapping[str, str] | None = None) -> dict:
        """POST /v1/completions (non-streaming) and return the parsed JSON. ``headers``: added to the request's
        (a trace's ``traceparent``)."""
        t0 = time.perf_counter()
        try:
            resp = await self._post(url, "/v1/completions", body, headers)
            try:
                if resp.status != 200:
                    raise await self._error_from(url, resp)
                raw = await resp.read()
                resp.release()  # fully read: the connection goes back to the pool
            except asyncio.TimeoutError:
                raise WorkerError(url, "timeout", f"no answer for {self.idle_timeout_s} s") from None
            except aiohttp.ClientError as e:
                raise WorkerError(url, "closed", f"connection lost: {e}") from None
            finally:
                resp.close()  # no-op after release; otherwise drops the connection (vLLM aborts the request)
        finally:
            wait.seconds += time.perf_counter() - t0
        try:
            out = json.loads(raw)
        except ValueError:
            raise WorkerError(url, "protocol", f"answered non-JSON: {raw[:200]!r}") from None
        if not isinstance(out, dict):
            raise WorkerError(url, "protocol", f"answered {type(out).__name__}, expected an object")
        return out

    def stream(self, url: str, body: dict, wait: Wait, headers: Mapping[str, str] | None = None) -> WorkerStream:
        """POST /v1/completions with stream=true; iterate it for each SSE event's JSON until [DONE].

        Raises WorkerError on an error event, a stream that ends without [DONE], or silence longer than the idle
        timeout. Leaving the iteration early (``aclose``: break under ``aclosing``, exception, cancellation) closes
        the connection. The stream's raw bytes can also be relayed (:mod:`..run.relay`).
        """
        return WorkerStream(self, url, body, wait, headers)

    async def health(self, url: str, timeout_s: float) -> tuple[bool, str]:
        p = await self.check(url, timeout_s)
        return p.ok, p.detail

    async def check(self, url: str, timeout_s: float) -> Probe:
        """GET /health, classified (see :class:`Probe`)."""
        try:
            async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                return Probe(resp.status == 200, f"HTTP {resp.status}", resp.status != 200)
        except asyncio.TimeoutError:
            return Probe(False, f"no answer within {timeout_s} s")
        except aiohttp.ClientError as e:
            return Probe(False, f"unreachable: {e}", refused(e))


class WorkerStream:
    """One worker's SSE stream: an async iterator of its events' JSON objects (see :meth:`WorkerClient.stream`)
    whose undelivered bytes (``buf``) a relay may consume directly, reading more with :meth:`fill`.

    A read that fails inside :meth:`fill` is kept (``pending``) and raised by the next ``__anext__``, so the
    caller that owns failure handling (``Generation``: retry, migrate) sees it exactly as if it had read it."""

    def __init__(self, client: WorkerClient, url: str, body: dict, wait: Wait,
                 headers: Mapping[str, str] | None = None) -> None:
        self.client = client
        self.url = url
        self.body = body
        self.headers = headers
        self.wait = wait
        self.buf = b""
        self.pending: WorkerError | None = None
        self._resp: aiohttp.ClientResponse | None = None
        self._dog: _Watchdog | None = None
        self._finished = False

    def __aiter__(self) -> WorkerStream:
        return self

    async def _open(self) -> aiohttp.ClientResponse:
        url, wait = self.url, self.wait
        t0 = time.perf_counter()
        try:
            resp = self._resp = await self.client._post(url, "/v1/completions", self.body, self.headers)
        finally:
            wait.seconds += time.perf_counter() - t0
        # aiohttp's sock_read timer (the wait for the answer's head) would be cancelled and scheduled anew on every
        # chunk received: the body's idle timeout is one _Watchdog instead
        proto = resp.connection.protocol if resp.connection is not None else None
        if proto is not None:
            proto.read_timeout = None
        dog = self._dog = _Watchdog(resp, self.client.idle_timeout_s)
        if resp.status != 200:
            t0 = dog.since = time.perf_counter()
            try:
                raise await self.client._error_from(url, resp)
            finally:
                dog.since = None
                wait.seconds += time.perf_counter() - t0
        return resp

    async def fill(self) -> bool:
        """Read what the worker sent next onto ``buf``; False (the failure kept in ``pending``) when the read
        failed or the stream ended."""
        resp, dog, url = self._resp, self._dog, self.url
        assert resp is not None and dog is not None
        t0 = dog.since = time.perf_counter()
        try:
            data = await resp.content.readany()
            if not data:
                raise WorkerError(url, "closed", "stream ended without [DONE]")
        except asyncio.TimeoutError:
            self.pending = WorkerError(url, "timeout", f"stream silent for {self.client.idle_timeout_s} s")
            return False
        except aiohttp.ClientError as e:
            self.pending = WorkerError(url, "closed", f"stream broken: {e}")
            return False
        except WorkerError as e:
            self.pending = e
            return False
        finally:
            dog.since = None
            self.wait.seconds += time.perf_counter() - t0
        self.buf += data
        return True

    @property
    def reader(self) -> aiohttp.StreamReader | None:
        """aiohttp's reader of the body (None before the answer's head)."""
        return self._resp.content if self._resp is not None else None

    @property
    def watchdog(self) -> _Watchdog | None:
        return self._dog

    def can_tap(self) -> bool:
        """True when :meth:`tap` may take this stream's reads (its head is in; :mod:`.reader_tap`'s check passed)."""
        return self._dog is not None and reader_tap.can_tap(self.reader)

    def tap(self, tap: StreamTap) -> None:
        """Hand every read from now on to ``tap`` in the socket callback, until :meth:`untap`, the stream's end or
        failure (``tap.ended``): :func:`.reader_tap.tap`."""
        reader = self.reader
        assert reader is not None and self.can_tap()
        reader_tap.tap(reader, tap)

    def untap(self) -> bool:
        """Stop handing reads to the tap; False when it had ended already (the stream's end or failure)."""
        return reader_tap.untap(self.reader)

    def fill_nowait(self) -> bool | None:
        """Move what the reader holds already onto ``buf`` without waiting: True when something came, None when
        nothing is there yet, False when the stream failed or ended (the failure kept in ``pending``)."""
        reader = self.reader
        assert reader is not None
        try:
            data = reader.read_nowait()
        except asyncio.TimeoutError:
            self.pending = WorkerError(self.url, "timeout", f"stream silent for {self.client.idle_timeout_s} s")
            return False
        except aiohttp.ClientError as e:
            self.pending = WorkerError(self.url, "closed", f"stream broken: {e}")
            return False
        if data:
            self.buf += data
            return True
        if reader.is_eof():
            self.pending = WorkerError(self.url, "closed", "stream ended without [DONE]")
            return False
        return None

    async def __anext__(self) -> dict:
        if self._finished:
            raise StopAsyncIteration
        try:
            if self._resp is None:
                await self._open()
            while True:
                buf = self.buf
                end = buf.find(b"\n\n")
                if end < 0:
                    if self.pending is None and await self.fill():
                        continue
                    err, self.pending = self.pending, None
                    assert err is not None
                    raise err
                event, self.buf = buf[:end], buf[end + 2:]
                payload = _sse_data(event)
                if payload is None:
                    continue
                if payload == b"[DONE]":
                    assert self._resp is not None
                    self._resp.release()  # complete: keep the connection for reuse
                    await self.aclose()
                    raise StopAsyncIteration
                try:
                    obj = json.loads(payload)
                except ValueError:
                    raise WorkerError(self.url, "protocol", f"bad SSE event: {payload[:200]!r}") from None
                if not isinstance(obj, dict):
                    raise WorkerError(self.url, "protocol", f"SSE event is not an object: {payload[:200]!r}")
                if "error" in obj:
                    raise WorkerError(self.url, "stream_error", str(obj["error"]), None, obj)
                return obj
        except WorkerError:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop the stream: an unfinished one's connection is dropped, so vLLM aborts the request."""
        self._finished = True
        if self._dog is not None:
            self._dog.stop()
        if self._resp is not None:
            self._resp.close()  # no-op after release


class _Watchdog:
    """A stream's idle timeout: one timer that looks every ``idle_s`` at whether the reader has been waiting
    (``since``: perf_counter when the current read began; None between reads, while the router is busy with what it
    read) for ``idle_s`` or more, and then fails the read with asyncio.TimeoutError. Rescheduling a timer per chunk,
    as aiohttp's sock_read does, costs the event loop a heap push per chunk."""

    __slots__ = ("resp", "idle_s", "since", "handle")

    def __init__(self, resp: aiohttp.ClientResponse, idle_s: float) -> None:
        self.resp = resp
        self.idle_s = idle_s
        self.since: float | None = None
        self.handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(idle_s, self._check)

    def _check(self) -> None:
        self.handle = None
        since = self.since
        left = self.idle_s if since is None else self.idle_s - (time.perf_counter() - since)
        if left <= 0:
            self.resp.content.set_exception(asyncio.TimeoutError())
            return
        self.handle = asyncio.get_running_loop().call_later(left, self._check)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


def _sse_data(event: bytes) -> bytes | None:
    """The data of one SSE event (lines 'data: ...' joined), or None for comments/empty events."""
    if event.startswith(b"data: ") and b"\n" not in event and not event.startswith(b"data:  "):
        return event[6:]  # vLLM's every event: one data line
    lines = [ln[5:].lstrip(b" ") for ln in event.replace(b"\r\n", b"\n").split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(lines)
