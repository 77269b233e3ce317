"""One call to one worker (:class:`Attempt`): P's unstreamed prefill, D's stream, a whole request's stream, or a
whole request sent unstreamed because it asks for ``prompt_logprobs`` (vLLM streams none).

An attempt owns its worker stream, turns the worker's events into :class:`~.delta.Delta`, reads a failed call
through the one rule (:func:`~.failures.classify`: retry elsewhere, migrate what is left, or the client's error),
can be interrupted (:meth:`Attempt.interrupt`: the request's deadline, a move, a client that left) and logs one
line when it ends: the request, the role, the worker, the outcome and its reason, the tokens out so far.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from ...settings import default
from ..errors import RouterError, deadline_exceeded
from ..fleet.registry import WorkerRegistry
from ..fleet.ticket import PlacementTicket
from ..metrics import RouterMetrics
from ..tracing import attempt_span, end_attempt, worker_headers
from ..workers.client import Worker, WorkerClient, WorkerError, WorkerStream
from .deadline import within
from .delta import Delta
from .early_dispatch import NO_CONTINUE
from .failures import Migrate, Outcome, Retry, classify, refusal
from .interrupts import Interrupts
from .output import Output
from .relay import Relay
from .textsync import TextSync
from .timings import Timings, transfer_stats

log = logging.getLogger("pdserve.router")


class Diverged(Exception):
    """An early-dispatched D's first token (regenerated from P's KV) is not P's, or a D asked to continue after P's
    first token could not (its one token marked ``NO_CONTINUE``): the caller falls back to the serial hand-off (D
    continues from prompt + [P's token])."""
_rechecks: set[asyncio.Task] = set()  # the probes in flight (held so they are not collected)


@dataclass
class AttemptContext:
    """What every attempt of one request's run shares: the worker client, the metrics and registry, the request's
    timings, output and interrupts, and the P -> D hand-off's clock (``handoff_since``: loop time P answered, until
    D's first token; ``handoff_timeout_s``: how long D may take to start; ``probe_timeout_s``: how long the probe of a
    worker that dropped an accepted call may take, the router's ``health_timeout_s``)."""

    client: WorkerClient
    metrics: RouterMetrics
    registry: WorkerRegistry
    t: Timings
    output: Output
    request_id: str
    interrupts: Interrupts = field(default_factory=Interrupts)
    handoff_timeout_s: float | None = None
    handoff_since: float | None = None
    probe_timeout_s: float = default("health_timeout_s", "router")


class Attempt:
    """One call to ``worker`` as ``role`` (prefill, decode, colocated) on ``ticket`` (see the module docstring).
    ``kind``: prefill (P's one-token call), decode (D's stream after a hand-off), whole (the whole request,
    streamed) or scored (the whole request, unstreamed, for ``prompt_logprobs``)."""

    def __init__(self, ctx: AttemptContext, ticket: PlacementTicket, worker: Worker, role: str, kind: str) -> None:
        self.ctx = ctx
        self.ticket = ticket
        self.worker = worker
        self.role = role
        self.kind = kind
        self.t = ctx.t
        self.interrupts = ctx.interrupts
        self.token_ids = ctx.output.token_ids  # the request's output: the relay appends what it passes through
        # the relay's count of the tokens it passed through (already in token_ids): timed and reported
        self.relayed: Callable[[int], None] = ctx.output.relayed
        self.stream: WorkerStream | None = None
        self.started = False  # the worker answered: a streamed token (or text), or the unstreamed answer
        self.outcome: str | None = None  # set once, when the attempt ends (and logged)
        self.span = attempt_span(kind, role, worker.url, ctx.request_id,  # None: the request is not traced
                                 getattr(ticket, "tokens_before", 0))

    # ---- interrupts and the outcome ----
    def interrupt(self, reason: str) -> bool:
        """Stop this attempt's await on its worker (the request's deadline, a move, a client that left): True when
        it was awaiting and is cancelled now, else the run sees ``reason`` before its next await."""
        return self.interrupts.interrupt(reason)

    def failed(self, e: WorkerError, mid_request: bool) -> Outcome:
        """A failed call: counted, the worker marked dead on evidence of death only (a refused connection; a timeout
        under load is the health probes' to judge), then read by the one rule and logged."""
        self.ctx.metrics.worker_errors.labels(self.role, e.kind).inc()
        if e.dead:
            self.ctx.registry.mark_dead(self.worker.url, str(e))
        out = classify(e, self.role, self.started, mid_request)
        if isinstance(out, Retry):
            self.end("retry" if not out.dead else "retry (dead)", out.reason)
        elif isinstance(out, Migrate):
            self.end("migrate", out.reason)
            if e.kind == "closed":
                self._recheck()
        else:
            self.end("error", f"{out.status} {out.message}")
        return out

    def _recheck(self) -> None:
        """The worker dropped a call it had accepted (the connection was lost): probe its /health now, not at the
        next health tick, so that a dead worker (its probe refused) is out before other requests are placed on it.
        The probe is judged as any other (:meth:`WorkerRegistry.report_probe`): a slow one does not take it out."""
        url, ctx = self.worker.url, self.ctx

        async def recheck() -> None:
            ctx.registry.report_probe(url, await ctx.client.check(url, ctx.probe_timeout_s))

        task = asyncio.get_running_loop().create_task(recheck())
        _rechecks.add(task)
        task.add_done_callback(_rechecks.discard)

    def end(self, outcome: str, reason: str) -> None:
        """The attempt's one log line (the first call only): ok at debug level, interrupted (the deadline, a move, the
        request closing it) at info, failures as warnings."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        if self.span is not None:
            end_attempt(self.span, outcome, reason, len(self.token_ids))
        level = logging.DEBUG if outcome == "ok" else logging.INFO if outcome == "interrupted" else logging.WARNING
        log.log(level, "request %s: %s attempt on %s worker %s: %s (%s); %d token(s) out", self.ctx.request_id,
                self.kind, self.role, self.worker.url, outcome, reason, len(self.token_ids))

    def _closed(self) -> None:
        reason = self.interrupts.reason
        self.end("interrupted", reason or "closed by the request: its output ended, its client left or another "
                                          "choice failed")

    # ---- the unstreamed call ----
    async def complete(self, body: dict[str, Any], streamed_client: bool = False) -> dict:
        """POST the body unstreamed (P's prefill, or a scored whole request); its answer, or the failure's outcome
        raised (nothing of it reached the client). ``streamed_client``: the client streams, so a worker's 400 is
        answered in the shape the worker gives a streamed request (:meth:`_streamed_refusal`)."""
        try:
            resp = await self.ctx.client.complete(self.worker.url, body, self.t.wait, **worker_headers(self.span))
        except WorkerError as e:
            out = self.failed(e, mid_request=False)
            if streamed_client and isinstance(out, RouterError) and out.status == 400 and not out.event:
                out = await self._streamed_refusal(body, out)
            raise out from None
        except asyncio.CancelledError:
            self._closed()
            raise
        self.started = True
        return resp

    async def _streamed_refusal(self, body: dict[str, Any], refused: RouterError) -> RouterError:
        """vLLM refuses some bodies in its serving layer (a 400, streamed or not) and some in its engine (inside the
        stream of a streamed request: 200 and an error event); an unstreamed call cannot tell which. So the same
        worker is asked the same body streamed, without the hand-off, and the client gets what it answers then:
        its error event, or the 400 as it was (also when it accepts the streamed body: leaving closes that stream,
        which aborts it)."""
        probe = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        probe["stream"] = True
        try:
            async with aclosing(self.ctx.client.stream(self.worker.url, probe, self.t.wait,
                                                       **worker_headers(self.span))) as objs:
                async for _ in objs:
                    break
        except WorkerError as e:
            again = refusal(e)
            if again is not None and again.event:
                return again
        return refused

    # ---- the streamed call ----
    async def deltas(self, body: dict[str, Any], own_text: bool, answered: bool, relay: bool = False,
                     keep_prompt_logprobs: bool = False, sync: TextSync | None = None,
                     skip_first: asyncio.Future[int] | None = None,
                     after_first: asyncio.Future[int] | None = None) -> AsyncGenerator[Delta, None]:
        """Stream the body: one delta per worker event, the finish last (its text made only when it goes out).
        ``own_text``: the router's detokenizer makes the text (P -> D, a migrated attempt); ``sync``: only until
        the worker's own text is settled (:mod:`.textsync`), then the worker's text as it is; ``answered``: the
        client has output of this request already (its failure is then a mid-request one); ``relay``: plain
        events may pass through as bytes (:mod:`.relay`) once the text is the worker's own and one delta is out.
        ``skip_first``: an early-dispatched D regenerates the first token, which the client has from P already: its
        first token must equal the future's (P's), else :class:`Diverged`; it is dropped, not yielded.
        ``after_first``: an early-dispatched D continues after P's first token (the future's): its stream starts at
        the second token, and follows P's (awaited); a first event marked ``NO_CONTINUE`` is :class:`Diverged`."""
        t, out = self.t, self.ctx.output
        now = time.perf_counter()
        if t.dispatch is None:
            t.dispatch = now
        t.d_sent = now
        last: tuple[list[int], dict[str, Any]] | None = None
        started = False  # self.started, kept local on the per-token path
        try:
            async with aclosing(self.ctx.client.stream(self.worker.url, body, self.t.wait,
                                                       **worker_headers(self.span))) as objs:
                if isinstance(objs, WorkerStream):
                    self.stream = objs
                while True:
                    try:
                        obj = await (objs.__anext__() if started else self._first(objs))
                    except StopAsyncIteration:
                        break
                    if "kv_transfer_params" in obj:
                        transfer_stats(obj, t)
                    choices = obj.get("choices") or []
                    if not choices:
                        continue  # usage chunk
                    c0 = choices[0]
                    ids = list(c0.get("token_ids") or [])
                    if after_first is not None:
                        await self._after_first(c0, after_first)
                        after_first = None
                    if skip_first is not None and ids:
                        ids = await self._drop_first(ids, c0, skip_first)
                        skip_first = None
                        if not ids and c0.get("finish_reason") is None:
                            self._start()
                            started = True
                            continue
                    if not started and (ids or c0.get("text")):
                        started = True
                        self._start()
                    if keep_prompt_logprobs and out.prompt_logprobs is None and c0.get("prompt_logprobs"):
                        out.prompt_logprobs = c0.get("prompt_logprobs")
                    if c0.get("finish_reason") is None:
                        d = out.delta(ids, c0, own_text)
                        if own_text and sync is not None and ids and out.settled(sync, c0, d):
                            own_text = False  # the worker's text from the next event on (.textsync)
                        yield d
                        if relay and started and not own_text and self.stream is not None:
                            yield Delta("", [], relay=Relay(self, self.stream))
                    else:  # read on to [DONE] (vLLM sends it at once) so the connection is reused, not dropped
                        t.d_end = time.perf_counter()
                        last = (ids, c0)
            if last is None:
                self.end("error", "the stream ended without a finish_reason")
            else:
                ids, c0 = last
                yield out.delta(ids, c0, own_text, final=True)
        except WorkerError as e:
            raise self.failed(e, mid_request=answered or self.started) from None
        finally:
            if t.d_end is None:
                t.d_end = time.perf_counter()
            self._closed()

    async def _drop_first(self, ids: list[int], c0: dict[str, Any], expected: asyncio.Future[int]) -> list[int]:
        """D's first event without its first token, which must be P's (awaited: D may be faster than P's answer)."""
        first = await asyncio.shield(expected)
        if ids[0] != first:
            raise Diverged(f"D's first token {ids[0]} is not P's {first}")
        if len(ids) > 1 and c0.get("logprobs") is not None:  # (logprobs per token: not cut here)
            raise Diverged("D's first event holds several tokens with logprobs")
        return ids[1:]

    @staticmethod
    async def _after_first(c0: dict[str, Any], first: asyncio.Future[int]) -> None:
        """D's first event once P's first token is out (D may be faster than P's answer): D continued after it, or
        :class:`Diverged` where D could not (its one token marked ``NO_CONTINUE``)."""
        await asyncio.shield(first)
        if c0.get("stop_reason") == NO_CONTINUE:
            raise Diverged("D could not continue after P's first token (its KV read ended without it)")

    def _start(self) -> None:
        self.started = True
        self.ctx.handoff_since = None
        self.t.d_first = time.perf_counter()
        if self.kind != "decode":
            self.ticket.prefill_done()  # whole request here: prompt computed

    async def _first(self, objs: AsyncIterator[dict]) -> dict:
        """D's first event within the hand-off deadline (P's answer + handoff_timeout_s)."""
        ctx = self.ctx
        if self.kind != "decode" or ctx.handoff_timeout_s is None or ctx.handoff_since is None:
            return await objs.__anext__()
        try:
            return await within(objs.__anext__(), ctx.handoff_since + ctx.handoff_timeout_s)
        except asyncio.TimeoutError:
            ctx.metrics.deadlines.labels("handoff").inc()
            self.end("error", "hand-off deadline")
            raise deadline_exceeded(f"the decode worker did not start within the hand-off deadline of "
                                    f"{ctx.handoff_timeout_s:g} s after the prefill (router --handoff-timeout-s)",
                                    "handoff_timeout") from None
