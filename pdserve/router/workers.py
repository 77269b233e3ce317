"""HTTP clients to the vLLM workers: one-shot completions, SSE streams, health probes.

Every call measures how long the router waited on the worker (``Wait``), so the router's own overhead can be
reported as end-to-end time minus upstream waits. Closing a stream early closes its connection, which makes
vLLM abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import aiohttp


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

    async def _post(self, url: str, path: str, body: dict) -> aiohttp.ClientResponse:
        try:
            return await self.session.post(url + path, data=json.dumps(body, separators=(",", ":")),
                                           headers={"Content-Type": "application/json"}, timeout=self._timeout())
        except aiohttp.SocketTimeoutError:  # connected and sent, then no answer (a non-streamed call answers at
            # the end): the worker has the request and is silent, it is not a refused connection
            raise WorkerError(url, "timeout", f"no answer for {self.idle_timeout_s} s") from None
        except asyncio.TimeoutError:  # the request was not accepted: safe to send it elsewhere
            raise WorkerError(url, "connect", f"no connection within {self.connect_timeout_s} s") from None
        except aiohttp.ClientConnectorError as e:  # no connection: the request never reached the worker
            raise WorkerError(url, "connect", f"cannot reach: {e}", dead=refused(e)) from None
        except aiohttp.ClientError as e:  # connected, then dropped before the answer: it died with the request
            raise WorkerError(url, "closed", f"connection lost before the answer: {e}") from None

    @staticmethod
    async def _error_from(url: str, resp: aiohttp.ClientResponse) -> WorkerError:
        try:
            raw = await resp.read()
            payload: Any = json.loads(raw)
        except Exception:  # not JSON (proxy page, truncated body)
            payload = None
        return WorkerError(url, "http", f"HTTP {resp.status}", resp.status, payload)

    async def complete(self, url: str, body: dict, wait: Wait) -> dict:
        """POST /v1/completions (non-streaming) and return the parsed JSON."""
        t0 = time.perf_counter()
        try:
            resp = await self._post(url, "/v1/completions", body)
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

    async def stream(self, url: str, body: dict, wait: Wait) -> AsyncGenerator[dict, None]:
        """POST /v1/completions with stream=true; yield each SSE event's JSON until [DONE].

        Raises WorkerError on an error event, a stream that ends without [DONE], or silence longer than the idle
        timeout. Leaving the iteration early (break, exception, cancellation) closes the connection.
        """
        t0 = time.perf_counter()
        try:
            resp = await self._post(url, "/v1/completions", body)
        finally:
            wait.seconds += time.perf_counter() - t0
        # aiohttp's sock_read timer (the wait for the answer's head) would be cancelled and scheduled anew on every
        # chunk received: the body's idle timeout is one _Watchdog instead
        proto = resp.connection.protocol if resp.connection is not None else None
        if proto is not None:
            proto.read_timeout = None
        dog = _Watchdog(resp, self.idle_timeout_s)
        try:
            if resp.status != 200:
                t0 = dog.since = time.perf_counter()
                try:
                    raise await self._error_from(url, resp)
                finally:
                    dog.since = None
                    wait.seconds += time.perf_counter() - t0
            buf = b""
            content = resp.content
            while True:
                t0 = dog.since = time.perf_counter()
                try:
                    data = await content.readany()
                    if not data:
                        raise WorkerError(url, "closed", "stream ended without [DONE]")
                except asyncio.TimeoutError:
                    raise WorkerError(url, "timeout", f"stream silent for {self.idle_timeout_s} s") from None
                except aiohttp.ClientError as e:
                    raise WorkerError(url, "closed", f"stream broken: {e}") from None
                finally:
                    dog.since = None
                    wait.seconds += time.perf_counter() - t0
                buf += data
                while True:
                    end = buf.find(b"\n\n")
                    if end < 0:
                        break
                    event, buf = buf[:end], buf[end + 2:]
                    payload = _sse_data(event)
                    if payload is None:
                        continue
                    if payload == b"[DONE]":
                        resp.release()  # complete: keep the connection for reuse
                        return
                    try:
                        obj = json.loads(payload)
                    except ValueError:
                        raise WorkerError(url, "protocol", f"bad SSE event: {payload[:200]!r}") from None
                    if not isinstance(obj, dict):
                        raise WorkerError(url, "protocol", f"SSE event is not an object: {payload[:200]!r}")
                    if "error" in obj:
                        raise WorkerError(url, "stream_error", str(obj["error"]), None, obj)
                    yield obj
        finally:
            dog.stop()
            resp.close()  # no-op after release; an unfinished stream is dropped, so vLLM aborts the request

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
