"""Drives one request across the workers: prefill on P (max_tokens=1, do_remote_decode), first token out at once,
then decode on D (prompt + [t1], P's kv_transfer_params), or the whole request on one worker (colocated).

The output is a stream of :class:`Delta` (text + token ids) after router-side stop-string handling, so a stop
string that spans the P/D boundary (t1's text + D's first text) is honoured exactly as one worker would: the
last len(stop)-1 characters are held back, the stop string is cut, D is aborted, and usage counts the tokens up
to the one that completed the stop string.

Failures (see :class:`Generation`): a worker that never accepted the request is left out and the request placed
again; one that accepted it and then died (connection closed, silent past the idle timeout, a 5xx) is
*migrated*: placed again with the prompt plus every token already streamed, ``max_tokens`` reduced by as many,
at most ``migration_limit`` times. The client sees one uninterrupted stream. Every request has a deadline, and
so has the P -> D hand-off; past either the client gets a 504 (or an error event after the first token).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from ..api.protocol import GenerationRequest
from ..api.tokenizer import IncrementalDetokenizer
from ..errors import RouterError, deadline_exceeded, upstream_failed
from ..fleet.move import MovableRun, Moved, wait_moves
from ..fleet.placement import Placement
from ..fleet.ticket import PlacementTicket
from ..fleet.workers import Worker, WorkerClient, WorkerError, WorkerStream
from ..metrics import RouterMetrics
from .deadline import within
from .delta import Delta, tokens_to
from .expiry import RequestDeadline
from .failures import RETRYABLE, Migrate, Retry, as_router_error, migratable
from .relay import Relay
from .stops import StopStrings
from .timings import Timings, transfer_stats

DEFAULT_MIGRATION_LIMIT = 2

log = logging.getLogger("pdserve.router")


class Generation(RequestDeadline, MovableRun):
    """One request's run. Iterate :meth:`run` for client-ready deltas; read ``timings`` afterwards.

    Each attempt runs on one ticket: ``prompt_ids`` + the tokens streamed so far (``token_ids``), ``max_tokens``
    less as many. The first attempt has none; a migrated one continues where the dead worker stopped, so with
    greedy sampling the whole output equals an undisturbed run's. The router's detokenizer (disaggregated mode)
    is fed every streamed token once, so text, stop strings and usage run on across a migration.
    """

    def __init__(self, req: GenerationRequest, prompt_ids: list[int], max_tokens: int, placement: Placement,
                 client: WorkerClient, metrics: RouterMetrics, timings: Timings, mode: str,
                 detokenizer: IncrementalDetokenizer | None = None, first_from_prefill: bool = True,
                 prefill_kv_params: dict[str, Any] | None = None, migration_limit: int = DEFAULT_MIGRATION_LIMIT,
                 request_timeout_s: float | None = None, handoff_timeout_s: float | None = None,
                 decode_kv_params: Callable[[str, Any], dict[str, Any] | None] | None = None) -> None:
        self.req = req
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.placement = placement
        self.client = client
        self.metrics = metrics
        self.t = timings
        self.t.mode = mode
        self.t.prompt_tokens = len(prompt_ids)
        self.colocated = mode == "colocated"
        # P -> D: text from the router's own detokenizer (see IncrementalDetokenizer); colocated: the worker's
        self.detok = None if self.colocated else detokenizer
        self._detok_fed = 0  # tokens the detokenizer has been given, in output order
        self.stopper = StopStrings(req.stop, req.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.ticket: PlacementTicket | None = None  # the placement in force; _raw closes it
        # True: P's first token goes to the client at once and D continues from prompt + [t1] (the pdserve
        # connector). False: P only computes the prompt's KV; D gets the prompt alone with P's kv_transfer_params,
        # regenerates the first token itself and its whole stream is the output (exact wherever D's state must
        # include the first token's sampling: structured outputs, vLLM's NixlConnector). Costs TTFT: the first
        # token then arrives after the hand-off.
        self.first_from_prefill = first_from_prefill
        self.prefill_kv_params = dict(prefill_kv_params or {"do_remote_decode": True})
        # the data plane's reading of P's kv_transfer_params for D (kv_protocol); raises RouterError when D would
        # misread them; None: P's params go to D as they are
        self.decode_kv_params = decode_kv_params
        self.prompt_logprobs: Any = None  # the worker's ``prompt_logprobs`` (P's, or the whole-request worker's)
        self.migration_limit = migration_limit
        self.migrations = 0
        self.request_timeout_s = request_timeout_s
        self.handoff_timeout_s = handoff_timeout_s
        self._deadline: float | None = None  # loop time by which the request must end
        self._timer: asyncio.TimerHandle | None = None  # fires _expire at the deadline
        self._waiter: asyncio.Task | None = None  # the task awaiting a worker delta in _next, if any
        self._expired = False  # the deadline passed
        self._cancelled = False  # _expire cancelled _waiter (not yet turned into the 504)
        self._handoff_since: float | None = None  # loop time P answered, until D's first token
        self._done = 0  # tokens streamed before the current attempt
        # the answer relays plain events as bytes (.relay) where nothing needs the per-token transform: set by the
        # app for a streamed single choice without stop strings, logprobs, tools or continuous usage
        self.passthrough = False

    # ---- the current attempt ----
    @property
    def _prompt(self) -> list[int]:
        return self.prompt_ids + self.token_ids[:self._done] if self._done else self.prompt_ids

    @property
    def _left(self) -> int:
        return self.max_tokens - self._done

    # ---- worker bodies ----
    def _body(self, prompt: list[int], max_tokens: int, stream: bool, computes_prompt: bool = True
              ) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                                "return_token_ids": True, **self.req.sampling}
        if not computes_prompt or self._done:
            body.pop("prompt_logprobs", None)  # only the worker that computes the prompt scores it (P)
        if self._done and isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(0, body["min_tokens"] - self._done)  # a migrated request: what is left
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.req.stop and self.colocated:
            # Only a worker that sees the whole output checks stop strings. P and D never get them: D would
            # miss a stop string spanning t1 and its own text, and its hold-back of text that could begin one
            # delays text behind token ids (usage would overcount). The router matches on the whole text and
            # closes D's stream at the hit, which aborts D.
            body["stop"] = self.req.stop
        if self.req.stop_token_ids:
            body["stop_token_ids"] = self.req.stop_token_ids
        if self.req.include_stop_str_in_output and self.colocated:
            body["include_stop_str_in_output"] = True
        return body

    def _fail(self, w: Worker, role: str, e: WorkerError) -> None:
        """Count a failed call; only evidence of death (a refused connection) takes the worker out. A timeout
        under load does not: the health probes decide over a window (WorkerRegistry.report_probe)."""
        self.metrics.worker_errors.labels(role, e.kind).inc()
        if e.dead:
            self.placement.registry.mark_dead(w.url, str(e))

    def _delta(self, ids: list[int], c0: dict[str, Any], own: bool, final: bool = False) -> Delta:
        """A worker event's delta. Its text: the router's detokenizer's when ``own`` (P -> D, or a migrated
        attempt; each token's piece kept, so a stop string can cut the tokens too), else the worker's."""
        finish, stop = (c0.get("finish_reason"), c0.get("stop_reason")) if final else (None, None)
        if own and self.detok is not None:
            self._detok_fed += len(ids)
            pieces = [self.detok.step(t) for t in ids]
            return Delta("".join(pieces), ids, finish, stop, c0.get("logprobs"), pieces=pieces)
        text = c0.get("text")
        return Delta(text if isinstance(text, str) else "", ids, finish, stop, c0.get("logprobs"))

    def _catch_up_detok(self) -> None:
        """Before a migrated attempt: give the detokenizer the streamed tokens whose text came from a worker
        (that text is out already), so it goes on exactly where the output is."""
        if self.detok is not None and self._detok_fed < len(self.token_ids):
            for t in self.token_ids[self._detok_fed:]:
                self.detok.step(t)
            self._detok_fed = len(self.token_ids)

    async def _next(self, raws: AsyncGenerator[Delta, None]) -> Delta:
        """The next raw delta, within the request's deadline (its cancellation closes the worker streams, so
        vLLM aborts them and frees their KV; the tickets are closed in run's finally). A move (``request_move``)
        cancels the await too: :class:`Moved` then ends the attempt."""
        if self._expired:
            raise self._deadline_error()
        if self._moving is not None:
            raise Moved(self._moving.prefill.url if self._moving.prefill is not None else "")
        if self._timer is None:
            deadline = self._deadline_at()
            if deadline is not None:
                self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)
        task = self._waiter = asyncio.current_task()
        try:
            return await raws.__anext__()
        except asyncio.CancelledError:
            if self._own_cancel(task):
                if self._moving is not None and not self._expired:
                    raise Moved(self._moving.prefill.url if self._moving.prefill is not None else "") from None
                raise self._deadline_error() from None
            raise
        finally:
            self._waiter = None

    # ---- the run ----
    def _accept(self, raw: Delta) -> Delta:
        """A worker's delta -> the client's: stop strings, token accounting, the conductor's progress."""
        if raw.relay is not None:
            return raw  # the relay does the accounting of what it passes through
        if not self.stopper.stops and raw.finish_reason is None:
            self._count(raw.token_ids)
            return raw  # nothing to cut or hold back: the worker's delta as it is
        before = len(self.stopper.text)
        text, hit = self.stopper.feed(raw.text)
        if hit is not None:  # the tokens after the one that completes the stop string were not output (vLLM)
            raw = raw.upto(tokens_to(raw.pieces, self.stopper.matched_end - before, len(raw.token_ids)))
            self._count(raw.token_ids)
            self.finish_reason, self.stop_reason = "stop", hit
            return Delta(text, raw.token_ids, "stop", hit, raw.logprobs)
        self._count(raw.token_ids)
        if raw.finish_reason is not None:
            self.finish_reason, self.stop_reason = raw.finish_reason, raw.stop_reason
            return Delta(text + self.stopper.flush(), raw.token_ids, raw.finish_reason, raw.stop_reason,
                         raw.logprobs)
        return Delta(text, raw.token_ids, logprobs=raw.logprobs)

    def _count(self, ids: list[int]) -> None:
        """Output tokens: kept, timed, and reported to the placement (the conductor's progress)."""
        if not ids:
            return
        self.token_ids.extend(ids)
        self.t.tokens += len(ids)
        now = time.perf_counter()
        if self.t.first_token is None:
            self.t.first_token = now
        if self._move_at is not None:  # the first token after a move
            self.metrics.move_gap.observe(now - self._move_at)
            self._move_at = None
        self.t.last_token = now
        if self.ticket is not None:
            self.ticket.progress(self.t.tokens, now)

    async def run(self) -> AsyncGenerator[Delta, None]:
        """Yield client-ready deltas; the last has finish_reason set. Raises RouterError before the first delta
        (the app answers with its status) and RouterError/WorkerError after (the app sends an error event).

        Places the request and runs it, attempt after attempt, each on a fresh ticket closed here exactly once.
        A worker that never accepted the request is left out of the next placement: for good when it refused the
        connection, for this round only when it was merely slow to accept (if nothing else is left the request
        waits on it again, within its deadline). A worker that died with the request is left out and the request
        migrated: the next attempt gets the prompt plus the tokens streamed so far. One generator from the worker
        stream's reader to the client: each streamed token passes three async-generator hops (two before D)."""
        dead: set[str] = set()
        slow: set[str] = set()
        lost: Migrate | None = None  # the last worker failure that moved the request
        movers = getattr(self.placement, "movers", None)
        if movers is not None:
            movers.add(self.req.request_id, self)
        try:
            while True:
                if self._expired:
                    raise self._deadline_error()
                self._done = len(self.token_ids)
                self._handoff_since = None
                if self._done:
                    self._catch_up_detok()
                if self._left <= 0:  # every token is out, only the finish was lost with the worker
                    yield self._accept(Delta("", [], "length"))
                    return
                try:
                    ticket, self._moving = self._moving or self.placement.choose(
                        self._prompt, frozenset(dead | slow), self.req.request_id, self._left), None
                except RouterError as e:
                    if e.status == 503 and slow:
                        slow.clear()  # only slow workers were left out: wait on them rather than fail
                        continue
                    if e.status == 503 and lost is not None:
                        raise upstream_failed(f"{lost.role} worker {lost.url} failed with the request ({lost.reason})"
                                              f" and no other worker can take it over: {e.message}") from None
                    raise
                self.ticket = ticket
                ticket.tokens_before = self._done
                try:
                    if ticket.waits:  # decodes moved off this prefill's worker: their tail prefills go first
                        await wait_moves(ticket.waits, ticket.wait_s)
                    gen = self._one_worker(ticket) if self.colocated or ticket.prefill is None \
                        else self._pd(ticket, dead)
                    async with aclosing(gen) as raws:
                        while True:
                            try:
                                raw = await self._next(raws)
                            except StopAsyncIteration:
                                break
                            out = self._accept(raw)
                            yield out
                            if out.finish_reason is not None:
                                return  # leaving closes D's stream (a stop string's hit: vLLM aborts it)
                    raise upstream_failed("worker stream ended without a finish_reason")
                except Retry as r:
                    (dead if r.dead else slow).add(r.url)
                except Moved as mv:  # not a failure: no worker error, not against the migration limit
                    self.metrics.moves.inc()
                    log.info("request %s: moved off %s after %d token(s)", self.req.request_id, mv.url,
                             len(self.token_ids))
                except Migrate as m:
                    dead.add(m.url)
                    lost = m
                    self.migrations += 1
                    if self.migrations > self.migration_limit:
                        raise upstream_failed(f"the request lost its worker {self.migrations} times, more than the "
                                              f"migration limit of {self.migration_limit} (router "
                                              f"--migration-limit); last: {m.reason}", "migration_limit") from None
                    self.metrics.migrations.labels(m.role).inc()
                    log.warning("request %s: %s worker %s failed after %d token(s) (%s); migrating it (%d of at "
                                "most %d)", self.req.request_id, m.role, m.url, len(self.token_ids), m.reason,
                                self.migrations, self.migration_limit)
                finally:
                    ticket.close()
        finally:
            if self._timer is not None:
                self._timer.cancel()
            if self._moving is not None:  # a move that came too late: the request ended first
                self._moving.close()
                self._moving = None
            if movers is not None:
                movers.remove(self.req.request_id, self)

    def _one_worker(self, ticket: PlacementTicket) -> AsyncGenerator[Delta, None]:
        """The whole request on ticket.decode: its stream as it is (no generator of its own in between)."""
        w = ticket.decode
        self.t.decode_worker = w.url
        body = self._body(self._prompt, self._left, True)
        return self._decode_stream(ticket, w, body, "colocated" if self.colocated else "decode")

    async def _pd(self, ticket: PlacementTicket, exclude: set[str]) -> AsyncGenerator[Delta, None]:
        p = ticket.prefill
        assert p is not None
        self.t.prefill_worker = p.url
        body = self._body(self._prompt, 1, False)
        if not self.first_from_prefill:  # P's token is thrown away: no grammar for P to compile
            body.pop("structured_outputs", None)
            body.pop("response_format", None)
        body["kv_transfer_params"] = dict(self.prefill_kv_params)
        now = time.perf_counter()
        if self.t.dispatch is None:
            self.t.dispatch = now
        self.t.p_sent = now
        try:
            resp = await self.client.complete(p.url, body, self.t.wait)
        except WorkerError as e:
            self._fail(p, "prefill", e)
            if e.kind in RETRYABLE:
                raise Retry(p.url, e.dead) from None
            if migratable(e):  # P took the request and died before its first token: place it again
                raise Migrate(p.url, "prefill", str(e)) from None
            raise as_router_error(e) from None
        self.t.p_done = time.perf_counter()
        self._handoff_since = asyncio.get_running_loop().time()
        ticket.prefill_done()
        try:
            c0 = resp["choices"][0]
            ids = c0.get("token_ids")
            text = c0.get("text") or ""
            finish = c0.get("finish_reason")
            stop_reason = c0.get("stop_reason")
            if not isinstance(ids, list) or len(ids) != 1 or not isinstance(text, str):
                raise ValueError(f"expected one token id, got token_ids={ids!r}")
        except (KeyError, IndexError, TypeError, ValueError) as e:
            self.metrics.worker_errors.labels("prefill", "protocol").inc()
            raise upstream_failed(f"prefill worker {p.url} answered an unexpected completion: {e}") from None
        kvp = resp.get("kv_transfer_params")
        transfer_stats(resp, self.t)
        if not self._done:
            self.prompt_logprobs = c0.get("prompt_logprobs")
        if not self.first_from_prefill:
            async with aclosing(self._regenerate(ticket, exclude, kvp)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        t1 = ids[0]
        text = self._delta([t1], c0, True).text
        logprobs = c0.get("logprobs")
        if finish == "stop" or self._left == 1:
            self.metrics.handoffs.labels("skipped").inc()
            yield Delta(text, [t1], finish or "length", stop_reason, logprobs)
            return
        if finish != "length":
            raise upstream_failed(f"prefill worker {p.url} finished with {finish!r} after one token")
        kvp = self._decode_params(ticket, kvp)
        yield Delta(text, [t1], logprobs=logprobs)
        self.metrics.handoffs.labels("kv" if isinstance(kvp, dict) else "no_kv").inc()
        d_body = self._body(self._prompt + [t1], self._left - 1, True, computes_prompt=False)
        if isinstance(kvp, dict):
            d_body["kv_transfer_params"] = kvp
        async with aclosing(self._hand_to_decode(ticket, exclude, d_body, after_first=True)) as deltas:
            async for delta in deltas:
                yield delta

    async def _regenerate(self, ticket: PlacementTicket, exclude: set[str], kvp: Any
                          ) -> AsyncGenerator[Delta, None]:
        """D gets the prompt alone with P's kv_transfer_params and produces the whole output itself."""
        kvp = self._decode_params(ticket, kvp)
        self.metrics.handoffs.labels("kv" if isinstance(kvp, dict) else "no_kv").inc()
        d_body = self._body(self._prompt, self._left, True, computes_prompt=False)
        if isinstance(kvp, dict):
            d_body["kv_transfer_params"] = kvp
        async with aclosing(self._hand_to_decode(ticket, exclude, d_body, after_first=False)) as deltas:
            async for delta in deltas:
                yield delta

    def _decode_params(self, ticket: PlacementTicket, kvp: Any) -> Any:
        if self.decode_kv_params is None:
            return kvp
        prefill = ticket.prefill.url if ticket.prefill is not None else "?"
        try:
            return self.decode_kv_params(prefill, kvp)
        except RouterError:
            self.metrics.worker_errors.labels("prefill", "protocol").inc()
            raise

    async def _hand_to_decode(self, ticket: PlacementTicket, exclude: set[str], d_body: dict[str, Any],
                              after_first: bool) -> AsyncGenerator[Delta, None]:
        """Run D's stream; a D that never accepted the decode is replaced (same P, P's blocks still leased); with
        no D left the request migrates (the whole of it on another worker, P included: it decodes locally)."""
        tries: set[str] = set()
        while True:
            d = ticket.decode
            self.t.decode_worker = d.url
            try:
                async with aclosing(self._decode_stream(ticket, d, d_body, "decode", after_first=after_first,
                                                        handoff=True)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            except Retry as r:  # D unreachable: P's blocks are still leased, move only the decode
                tries.add(r.url)
                try:
                    ticket.replace_decode(frozenset(exclude | tries))
                except RouterError as e:
                    raise Migrate(r.url, "decode", e.message) from None

    async def _first(self, objs: AsyncIterator[dict], handoff: bool) -> dict:
        """D's first event within the hand-off deadline (P's answer + handoff_timeout_s)."""
        if not handoff or self.handoff_timeout_s is None or self._handoff_since is None:
            return await objs.__anext__()
        try:
            return await within(objs.__anext__(), self._handoff_since + self.handoff_timeout_s)
        except asyncio.TimeoutError:
            self.metrics.deadlines.labels("handoff").inc()
            raise deadline_exceeded(f"the decode worker did not start within the hand-off deadline of "
                                    f"{self.handoff_timeout_s:g} s after the prefill (router --handoff-timeout-s)",
                                    "handoff_timeout") from None

    async def _decode_stream(self, ticket: PlacementTicket, w: Worker, body: dict, role: str,
                             after_first: bool = False, handoff: bool = False) -> AsyncGenerator[Delta, None]:
        now = time.perf_counter()
        if self.t.dispatch is None:
            self.t.dispatch = now
        self.t.d_sent = now
        own_text = after_first or self._done > 0  # the router's detokenizer carries the text on
        # the worker's text as it is, nothing to cut: its plain events may go to the client as bytes
        relay = self.passthrough and not own_text and not self.stopper.stops
        started = False
        last: tuple[list[int], dict[str, Any]] | None = None
        try:
            async with aclosing(self.client.stream(w.url, body, self.t.wait)) as objs:
                while True:
                    try:
                        obj = await (objs.__anext__() if started else self._first(objs, handoff))
                    except StopAsyncIteration:
                        break
                    if "kv_transfer_params" in obj:
                        transfer_stats(obj, self.t)
                    choices = obj.get("choices") or []
                    if not choices:
                        continue  # usage chunk
                    c0 = choices[0]
                    ids = list(c0.get("token_ids") or [])
                    if not started and (ids or c0.get("text")):
                        started = True
                        self._handoff_since = None
                        self.t.d_first = time.perf_counter()
                        if not after_first:
                            ticket.prefill_done()  # whole request here: prompt computed
                    if not after_first and not self._done and self.prompt_logprobs is None \
                            and c0.get("prompt_logprobs"):
                        self.prompt_logprobs = c0.get("prompt_logprobs")
                    if c0.get("finish_reason") is None:
                        yield self._delta(ids, c0, own_text)
                        if relay and started and isinstance(objs, WorkerStream):
                            yield Delta("", [], relay=Relay(self, objs))
                    else:  # read on to [DONE] (vLLM sends it at once) so the connection is reused, not dropped
                        self.t.d_end = time.perf_counter()
                        last = (ids, c0)  # its text only when it goes out: a lost finish is regenerated
            if last is not None:
                ids, c0 = last
                yield self._delta(ids, c0, own_text, final=True)
        except WorkerError as e:
            self._fail(w, role, e)
            if e.kind in RETRYABLE and not started:
                raise Retry(w.url, e.dead) from None
            if migratable(e):
                raise Migrate(w.url, role, str(e)) from None
            if not after_first and not started and not self._done:
                raise as_router_error(e) from None
            raise upstream_failed(f"{role} worker {w.url} failed mid-request: {e}") from None
        finally:
            if self.t.d_end is None:
                self.t.d_end = time.perf_counter()
