"""The pass-through path: a worker's plain streamed events relayed to the client as bytes.

Once a choice's first chunk is out and nothing needs the per-token transform (one choice, no stop strings, no
logprobs, tools or continuous usage, the worker's own text: not a P -> D hand-off nor a migrated attempt, whose
text the router's detokenizer makes), most of vLLM's events are *plain*: one choice with a text and token ids and
nothing else set::

    data: {"id":...,"choices":[{"index":0,"text":"<json>","logprobs":null,"finish_reason":null,
           "stop_reason":null,"prompt_token_ids":null,"token_ids":[<ids>]}]}

:func:`plain_event` parses an event into a typed shape (msgspec: faster than finding vLLM's exact bytes was, and
indifferent to spacing, key order and escapes), and :class:`Relay` splices the text's JSON string and the ids into
the router's prebuilt chunk (its own id, created and model), the very bytes ``ResponseBuilder.text_chunk`` writes,
in one coroutine: read what the worker sent, rewrite
every whole plain event in it, one write to the client. The first event that is not plain (a finish, usage, an
error, anything unexpected) ends the relay with that event left unread, and the full path
(``Attempt.deltas``) takes over from it; so does a failed read (kept by the stream and raised on the full path:
retry, migration) and an interrupt of the attempt (the request's deadline, a move: :mod:`.interrupts`).

Token ids are parsed too, because usage, the conductor's progress and migration need them.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from typing import Annotated, Literal, Protocol

import msgspec
from aiohttp import web

from ..workers.client import WorkerStream
from .interrupts import Interrupts
from .timings import Timings


class RelaySource(Protocol):
    """What a relay needs of the attempt whose stream it passes through (:class:`~.attempt.Attempt`)."""

    t: Timings
    interrupts: Interrupts
    token_ids: list[int]  # the request's output: the relay appends the ids it passes through

    def relayed(self, n: int) -> None:
        """``n`` more tokens passed through (already appended): timed and reported to the placement."""
        ...


TokenId = Annotated[int, msgspec.Meta(ge=0)]


class _PlainChoice(msgspec.Struct, forbid_unknown_fields=True):
    """The one choice of a plain event: text and ids, nothing else set (an unknown field: not plain)."""

    index: Literal[0]
    text: str
    token_ids: list[TokenId]
    logprobs: None = None
    finish_reason: None = None
    stop_reason: None = None
    prompt_token_ids: None = None


class _PlainEvent(msgspec.Struct, forbid_unknown_fields=True):
    """A streamed completion event with one plain choice and no usage (an unknown field: not plain)."""

    choices: tuple[_PlainChoice]
    id: str = ""
    object: str = ""
    created: int = 0
    model: str = ""
    usage: None = None


_DECODE = msgspec.json.Decoder(_PlainEvent).decode
_ENCODE = msgspec.json.Encoder().encode  # a str as json.dumps(ensure_ascii=False) writes it, code point for code point


def plain_event(event: bytes) -> tuple[bytes, list[int]] | None:
    """(the JSON string of ``text``, as the router's chunks write it; the token ids) of a plain streamed completion
    event (``data: {...}`` without the blank line), or None for any other event.

    The event is parsed (msgspec, typed: any spacing, any key order, any escapes); plain means one choice, index 0,
    a text and token ids, and nothing else set: no finish, stop reason, logprobs, prompt ids or usage, and no field
    this shape does not know."""
    if not event.startswith(b"data:"):
        return None
    try:
        choice = _DECODE(event[5:]).choices[0]
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return _ENCODE(choice.text), choice.token_ids


_WRITE_LIMIT = 1 << 16  # the client's unsent bytes past which the relay waits for it (coroutine path)
_END_CHUNK = b"}]}\n\n"

class Relay:
    """One pass-through stretch of a choice's stream, offered by an attempt (``Attempt.deltas``, as a
    :class:`~.delta.Delta` with ``relay`` set) and run by the answer (``answer.stream``).

    What the worker's reader holds already is rewritten and written from the task (coroutine path); then, while the
    client keeps up, the relay goes *inline*: it taps the stream (:meth:`WorkerStream.tap`), so the socket callback
    rewrites each read and writes it to the client's transport (one event-loop iteration per read, no task wake-up,
    no aiohttp writer), and the task sleeps until the first event that is not plain, the stream's end or failure,
    an interrupt of the attempt (the deadline, a move), or the client leaving."""

    __slots__ = ("source", "stream", "interrupts", "relayed", "tokens", "head", "tail", "with_ids", "transport",
                 "chunked", "partial", "woken", "busy")

    def __init__(self, source: RelaySource, stream: WorkerStream) -> None:
        self.source = source
        self.stream = stream
        self.interrupts = source.interrupts
        self.relayed = 0  # events passed through
        self.tokens = 0
        self.head = self.tail = self.partial = b""
        self.with_ids = False
        self.transport: asyncio.Transport | None = None
        self.chunked = False
        self.woken: asyncio.Future[None] | None = None
        self.busy = 0.0  # seconds spent in the socket callback (inline), not waiting on the worker

    def _rewrite(self, buf: bytes) -> tuple[bytes, int, bool]:
        """(the client's bytes for the whole plain events at the start of ``buf``, where they end, whether an event
        that is not plain comes next); counts their tokens."""
        head, tail, with_ids = self.head, self.tail, self.with_ids
        token_ids = self.source.token_ids
        pos = 0
        out: list[bytes] = []
        n = 0
        stop = False
        while True:
            end = buf.find(b"\n\n", pos)
            if end < 0:
                break
            parts = plain_event(buf[pos:end])
            if parts is None:
                stop = True
                break
            text, ids = parts
            token_ids += ids
            n += len(ids)
            out.append(head + text + tail + _ENCODE(ids) + _END_CHUNK if with_ids else head + text + tail + _END_CHUNK)
            pos = end + 2
        if not out:
            return b"", pos, stop
        self.relayed += len(out)
        if n:
            self.tokens += n
            self.source.relayed(n)
        return out[0] if len(out) == 1 else b"".join(out), pos, stop

    async def run(self, resp: web.StreamResponse, transport: asyncio.Transport | None, head: bytes, tail: bytes,
                  with_ids: bool) -> int:
        """Pass plain events through as ``head + text + tail [+ ids] + "}]}\\n\\n"``; return the tokens relayed.
        Returns at the first event that is not plain (left unread), a failed read (kept by the stream), an
        interrupt of the attempt (the deadline, a move) or the client leaving (raised)."""
        self.head, self.tail, self.with_ids = head, tail, with_ids
        self.transport = transport
        self.chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
        stream, interrupts = self.stream, self.interrupts
        t = self.source.t
        while True:
            buf = stream.buf
            out, pos, stop = self._rewrite(buf)
            if pos:
                stream.buf = buf[pos:]
            if out:
                t0 = time.perf_counter()
                await resp.write(out)
                t.client.seconds += time.perf_counter() - t0
            if stop or interrupts.reason is not None:
                return self.tokens
            got = stream.fill_nowait()
            if got:
                continue
            if got is False:
                return self.tokens
            if not await (self._inline(resp) if self._can_inline() else self._fill()):
                return self.tokens

    def _can_inline(self) -> bool:
        tr = self.transport
        return tr is not None and not tr.is_closing() and tr.get_write_buffer_size() < _WRITE_LIMIT \
            and self.stream.can_tap()

    async def _fill(self) -> bool:
        """Read more from the worker; an interrupt of the attempt (the deadline, a move) cancels this await and
        ends the relay (False)."""
        interrupts = self.interrupts
        task = interrupts.begin()
        try:
            return await self.stream.fill()
        except asyncio.CancelledError:
            if interrupts.ours(task):
                return False
            raise
        finally:
            interrupts.end()

    async def _inline(self, resp: web.StreamResponse) -> bool:
        """Relay from the socket callback (the stream's tap) until it hands back; False on an interrupt."""
        stream, interrupts = self.stream, self.interrupts
        dog = stream.watchdog
        assert dog is not None
        stream.tap(self)
        self.partial, stream.buf = stream.buf, b""
        self.woken = asyncio.get_running_loop().create_future()
        self.busy = 0.0
        task = interrupts.begin()
        t0 = dog.since = time.perf_counter()
        try:
            await self.woken
            return True
        except asyncio.CancelledError:
            if interrupts.ours(task):  # the deadline (or a move) ends the relay
                return False
            raise
        finally:
            interrupts.end()
            dog.since = None
            if stream.untap():  # ended from this side: the partial event stays ours
                stream.buf = self.partial + stream.buf
                self.partial = b""
            stream.wait.seconds += time.perf_counter() - t0 - self.busy
            self.woken = None
            tr = self.transport
            if tr is not None and tr.get_write_buffer_size() >= _WRITE_LIMIT and not tr.is_closing():
                with warnings.catch_warnings():  # aiohttp deprecates drain; write() would not wait for our bytes
                    warnings.simplefilter("ignore", DeprecationWarning)
                    await resp.drain()

    def feed(self, data: bytes) -> bytes:
        """Inline: the worker's next bytes. Relays the whole plain events and keeps a partial one; returns the bytes
        for the reader (from the first event that is not plain on) when the relay hands back, else b""."""
        t0 = time.perf_counter()
        buf = self.partial + data if self.partial else data
        tr = self.transport
        assert tr is not None
        if tr.is_closing():  # the client is gone: the task is being cancelled
            self._hand_back()
            return buf
        out, pos, stop = self._rewrite(buf)
        if out:
            tr.write(b"%x\r\n%b\r\n" % (len(out), out) if self.chunked else out)
        if stop or self.interrupts.reason is not None or tr.get_write_buffer_size() >= _WRITE_LIMIT:
            self._hand_back()
            rest = buf[pos:]
        else:
            self.partial = buf[pos:]
            rest = b""
        now = time.perf_counter()
        dog = self.stream.watchdog
        if dog is not None and dog.since is not None:
            dog.since = now  # the worker is not silent
        self.busy += now - t0
        return rest

    def _hand_back(self) -> None:
        self.partial = b""
        self.stream.untap()
        if self.woken is not None and not self.woken.done():
            self.woken.set_result(None)

    def ended(self) -> bytes:
        """The stream ends or fails while inline: wake the task; the reader gets the partial event."""
        partial = self.partial
        self._hand_back()
        return partial
