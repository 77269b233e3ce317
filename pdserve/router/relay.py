"""The pass-through path: a worker's plain streamed events relayed to the client as bytes.

Once a choice's first chunk is out and nothing needs the per-token transform (one choice, no stop strings, no
logprobs, tools or continuous usage, the worker's own text: not a P -> D hand-off nor a migrated attempt, whose
text the router's detokenizer makes), most of vLLM's events look alike::

    data: {"id":...,"choices":[{"index":0,"text":"<json>","logprobs":null,"finish_reason":null,
           "stop_reason":null,"prompt_token_ids":null,"token_ids":[<ids>]}]}

:func:`plain_event` finds the raw JSON string of ``text`` and the raw ``token_ids`` list with ``bytes.find``
(no ``json.loads``), and :class:`Relay` splices them into the router's prebuilt chunk (its own id, created and
model), the very bytes ``ResponseBuilder.text_chunk`` writes, in one coroutine: read what the worker sent, rewrite
every whole plain event in it, one write to the client. The first event that is not plain (a finish, usage, an
error, anything unexpected) ends the relay with that event left unread, and the full path
(``Generation._decode_stream``) takes over from it; so does a failed read (kept by the stream and raised on the
full path: retry, migration) and the request's deadline (``Generation._expire``).

Token ids are still parsed (``int`` per id), because usage, the conductor's progress and migration need them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .workers import WorkerStream

if TYPE_CHECKING:
    from .handoff import Generation

_CHOICES = b'"choices":[{"index":0,"text":'
_TAIL = b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":['
_END = b"]}]}"


def plain_event(event: bytes) -> tuple[bytes, bytes] | None:
    """(the raw JSON string of ``text``, quotes included; the raw ``token_ids`` list, brackets included) of one of
    vLLM's plain streamed completion events (``data: {...}`` without the blank line), or None for any other event.

    Inside a JSON string a quote is always escaped, so neither marker can occur inside the text: the text is the
    bytes between them, as vLLM (pydantic) encoded it, which is what ``json.dumps(text, ensure_ascii=False)``
    writes (checked in tests/unit/test_router_relay.py against vLLM's own response classes)."""
    if not event.startswith(b"data: {") or not event.endswith(_END):
        return None
    c = event.find(_CHOICES)
    if c < 0:
        return None
    start = c + len(_CHOICES)
    t = event.find(_TAIL, start)
    if t < 0:
        return None
    text = event[start:t]
    ids = event[t + len(_TAIL) - 1:-3]
    if len(text) < 2 or text[0] != 0x22 or text[-1] != 0x22 or ids[-1:] != b"]":
        return None
    digits = ids[1:-1]
    if digits and (not digits.replace(b",", b"").isdigit() or b",," in digits or digits[0] == 0x2C
                   or digits[-1] == 0x2C):
        return None
    return text, ids


def parse_ids(raw: bytes, into: list[int]) -> int:
    """Append the ids of a raw ``[1,2]`` list to ``into``; return how many."""
    if len(raw) <= 2:
        return 0
    ids = [int(x) for x in raw[1:-1].split(b",")]
    into.extend(ids)
    return len(ids)


Write = Callable[[bytes], Awaitable[None]]


class Relay:
    """One pass-through stretch of a choice's stream, offered by ``Generation._decode_stream`` (as a
    :class:`~.handoff.Delta` with ``relay`` set) and run by the answer (``answer.stream``)."""

    __slots__ = ("gen", "stream", "relayed")

    def __init__(self, gen: Generation, stream: WorkerStream) -> None:
        self.gen = gen
        self.stream = stream
        self.relayed = 0  # events passed through

    async def run(self, write: Write, head: bytes, tail: bytes, with_ids: bool) -> int:
        """Pass plain events through as ``head + text + tail [+ ids] + "}]}\\n\\n"``; return the tokens relayed.
        Returns at the first event that is not plain, a failed read, or the request's deadline."""
        gen, stream = self.gen, self.stream
        t = gen.t
        ticket = gen.ticket
        token_ids = gen.token_ids
        tokens = 0
        end_chunk = b"}]}\n\n"
        while True:
            buf = stream.buf
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
                n += parse_ids(ids, token_ids)
                out.append(head + text + tail + ids + end_chunk if with_ids else head + text + tail + end_chunk)
                pos = end + 2
            if pos:
                stream.buf = buf[pos:]
            if out:
                self.relayed += len(out)
                tokens += n
                if n:
                    t.tokens += n
                    t.relayed += n
                    now = t.last_token = time.perf_counter()
                    if ticket is not None:
                        ticket.progress(t.tokens, now)
                t0 = time.perf_counter()
                await write(out[0] if len(out) == 1 else b"".join(out))
                t.client.seconds += time.perf_counter() - t0
            if stop or gen._expired:
                return tokens
            if not await self._fill():
                return tokens

    async def _fill(self) -> bool:
        """Read more from the worker within the request's deadline: ``Generation._expire`` cancels this task while
        it awaits here (as it does in ``Generation._next``); the relay then ends and the full path raises the 504."""
        gen = self.gen
        task = gen._waiter = asyncio.current_task()
        try:
            return await self.stream.fill()
        except asyncio.CancelledError:
            if gen._cancelled and task is not None:
                gen._cancelled = False
                uncancel = getattr(task, "uncancel", None)  # Python 3.11+; 3.10 takes it as ours
                if uncancel is None or uncancel() == 0:  # ours alone (not also the client's or the server's)
                    return False
            raise
        finally:
            gen._waiter = None
