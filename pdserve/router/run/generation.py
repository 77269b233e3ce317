"""Drives one request across the workers: prefill on P (max_tokens=1, do_remote_decode), first token out at once,
then decode on D (prompt + [t1], P's kv_transfer_params), or the whole request on one worker (colocated).

The output is a stream of :class:`Delta` (text + token ids) after router-side stop-string handling, so a stop
string that spans the P/D boundary (t1's text + D's first text) is honoured exactly as one worker would: the
last len(stop)-1 characters are held back, the stop string is cut, D is aborted, and usage counts the tokens up
to the one that completed the stop string.

Each call to a worker is an :class:`~.attempt.Attempt`; a failed one reads through one rule
(:func:`~.failures.classify`): a worker that never accepted the request is left out and the request placed again;
one that accepted it and then died (connection closed, silent past the idle timeout, a 5xx) is *migrated*: placed
again with the prompt plus every token already streamed, ``max_tokens`` reduced by as many, at most
``migration_limit`` times. The client sees one uninterrupted stream. Every request has a deadline, and so has the
P -> D hand-off; past either the client gets a 504 (or an error event after the first token).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from ...hashing import domain_root
from ...settings import default
from ..api.protocol import GenerationRequest, seeded_random
from ..api.tokenizer import IncrementalDetokenizer
from ..errors import RouterError, deadline_exceeded, upstream_failed
from ..fleet.move import MovableRun, Moved, wait_moves
from ..fleet.placement import Placement
from ..fleet.ticket import PlacementTicket
from ..metrics import RouterMetrics
from ..tracing import move_span
from ..workers.client import WorkerClient
from .attempt import Attempt, AttemptContext, Diverged
from .deadline import Deadline, within
from .delta import Delta
from .early_dispatch import CONTINUE, EarlyDispatch, early_allowed
from .failures import Migrate, Retry
from .output import Output
from .stops import StopStrings
from .textsync import TextSync
from .timings import Timings, transfer_stats

__all__ = ["DEFAULT_MIGRATION_LIMIT", "Generation", "GenerationOptions", "Timings"]

DEFAULT_MIGRATION_LIMIT: int = default("migration_limit", "router")

log = logging.getLogger("pdserve.router")
# vllm_xargs key naming the draws a migrated seeded request skips (pdserve.vllm.rng_skip.SKIP_KEY)
RNG_SKIP_KEY = "pdserve_rng_skip"


@dataclass(frozen=True)
class GenerationOptions:
    """How a request's run speaks to its workers and how long it may take.

    first_from_prefill: True: P's first token goes to the client at once and D continues from prompt + [t1] (the
    pdserve connector). False: P only computes the prompt's KV; D gets the prompt alone with P's
    kv_transfer_params, regenerates the first token itself and its whole stream is the output (exact wherever D's
    state must include the first token's sampling: structured outputs, vLLM's NixlConnector); TTFT then includes
    the hand-off. prefill_kv_params: P's ``kv_transfer_params``. decode_kv_params: the data plane's reading of P's
    answer for D (:mod:`.kv_protocol`; raises RouterError when D would misread them; None: P's params go to D as
    they are). migration_limit, request_timeout_s, handoff_timeout_s: the router's flags of those names."""

    first_from_prefill: bool = True
    prefill_kv_params: dict[str, Any] | None = None
    decode_kv_params: Callable[..., Any] | None = None  # (prefill_url, kvp, finish) -> params or their awaitable
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    request_timeout_s: float | None = None
    handoff_timeout_s: float | None = None
    probe_timeout_s: float = default("health_timeout_s", "router")
    early: EarlyDispatch | None = None  # early dispatch to D (the data plane's, where it allows one)


class Generation:
    """One request's run. Iterate :meth:`run` for client-ready deltas; read ``timings`` afterwards.

    Each round runs on one ticket: ``prompt_ids`` + the tokens streamed so far, ``max_tokens`` less as many. The
    first has none; a migrated one continues where the dead worker stopped, so with greedy sampling the whole output
    equals an undisturbed run's. The router's detokenizer (disaggregated mode) is fed every streamed token once, so
    text, stop strings and usage run on across a migration (:class:`~.output.Output`).
    """

    def __init__(self, req: GenerationRequest, prompt_ids: list[int], max_tokens: int, placement: Placement,
                 client: WorkerClient, metrics: RouterMetrics, timings: Timings, mode: str,
                 detokenizer: IncrementalDetokenizer | None = None, options: GenerationOptions | None = None) -> None:
        o = options or GenerationOptions()
        self.req = req
        self.prompt_ids = prompt_ids
        # the root of the prompt's block keys: its cache salt and LoRA adapter, so the request is placed by its
        # own domain's blocks only (pdserve.hashing.domain_root; vLLM folds both into its block hashes too)
        self.domain = domain_root(req.sampling.get("cache_salt"), req.lora)
        self.max_tokens = max_tokens
        self.placement = placement
        self.metrics = metrics
        self.t = timings
        self.t.mode = mode
        self.t.prompt_tokens = len(prompt_ids)
        self.colocated = mode == "colocated"
        self.first_from_prefill = o.first_from_prefill
        self.prefill_kv_params = dict(o.prefill_kv_params or {"do_remote_decode": True})
        self.decode_kv_params = o.decode_kv_params
        self.early = o.early
        self.migration_limit = o.migration_limit
        self.migrations = 0
        # P -> D: text from the router's own detokenizer (see IncrementalDetokenizer); colocated: the worker's
        self.output = Output(StopStrings(req.stop, req.include_stop_str_in_output), timings,
                             None if self.colocated else detokenizer, metrics.move_gap)
        self.ctx = AttemptContext(client, metrics, placement.registry, timings, self.output, req.request_id,
                                  handoff_timeout_s=o.handoff_timeout_s, probe_timeout_s=o.probe_timeout_s)
        self.deadline = Deadline(o.request_timeout_s, timings.arrive, metrics, lambda: self.interrupt("deadline"))
        self.moves = MovableRun(self)
        self.ticket: PlacementTicket | None = None  # the placement in force; run closes it
        self.attempt: Attempt | None = None  # the call to a worker in progress (or the last one)
        self._done = 0  # tokens streamed before the current round
        # the answer relays plain events as bytes (.relay) where nothing needs the per-token transform: set by the
        # app for a streamed single choice without stop strings, logprobs, tools or continuous usage
        self.passthrough = False

    # ---- what the answer reads ----
    @property
    def token_ids(self) -> list[int]:
        return self.output.token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason

    @property
    def stop_reason(self) -> Any:
        return self.output.stop_reason

    @property
    def prompt_logprobs(self) -> Any:
        return self.output.prompt_logprobs

    # ---- interrupts and moves (MoveSubject) ----
    def interrupt(self, reason: str) -> bool:
        """Stop the run's await on its worker: the deadline, a move (see ``Attempt.interrupt``)."""
        return self.ctx.interrupts.interrupt(reason)

    def decoding(self) -> bool:
        return (not self.colocated and self.first_from_prefill and self.ctx.handoff_since is None
                and self.output.finish_reason is None)

    def tokens_left(self) -> int:
        return self.max_tokens - len(self.output.token_ids)

    # ---- the current round ----
    @property
    def _prompt(self) -> list[int]:
        return self.prompt_ids + self.output.token_ids[:self._done] if self._done else self.prompt_ids

    @property
    def _left(self) -> int:
        return self.max_tokens - self._done

    def _body(self, prompt: list[int], max_tokens: int, stream: bool, computes_prompt: bool = True,
              whole_output: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                                "return_token_ids": True, **self.req.sampling}
        if self.req.lora:  # P and D (and a colocated worker) run the adapter: vLLM picks it by model name
            body["model"] = self.req.lora
        if not computes_prompt or self._done:
            body.pop("prompt_logprobs", None)  # only the worker that computes the prompt scores it (P)
        if isinstance(body.get("min_tokens"), int):  # what is left of it after the tokens already output (P's t1,
            # a migration's), at most this call's max_tokens (P's is 1)
            body["min_tokens"] = min(max(0, body["min_tokens"] - (len(prompt) - len(self.prompt_ids))), max_tokens)
        if stream:
            body["stream_options"] = {"include_usage": True}
        sees_whole = self.colocated or (whole_output and not self._done)
        if self.req.stop and sees_whole:
            # Only a worker that sees the whole output checks stop strings (a colocated worker, a whole request on
            # D, a D that regenerates the first token): it then stops as one worker does, grammar and all. P never
            # gets them, nor a D after P's t1: it would miss a stop string spanning t1 and its own text, and its
            # hold-back of text that could begin one delays text behind token ids (usage would overcount). The
            # router matches on the whole text and closes D's stream at the hit, which aborts D.
            body["stop"] = self.req.stop
        if self.req.stop_token_ids:
            body["stop_token_ids"] = self.req.stop_token_ids
        if self.req.include_stop_str_in_output and sees_whole:
            body["include_stop_str_in_output"] = True
        if self._done and seeded_random(self.req.sampling):
            # a migrated seeded request: the worker's fresh generator skips the draws one worker made for the
            # tokens already output (pdserve/vllm/rng_skip.py), so the stream continues where it was
            body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), RNG_SKIP_KEY: self._done}
        return body

    def _interrupted(self) -> Exception:
        """What ends an interrupted attempt: the deadline's 504 before a move."""
        return self.deadline.error() if self.deadline.expired else self.moves.moved()

    async def _next(self, raws: AsyncGenerator[Delta, None]) -> Delta:
        """The next raw delta, unless interrupted: the deadline or a move cancel the await (which closes the worker
        streams, so vLLM aborts them and frees their KV; the tickets are closed in run's finally)."""
        interrupts = self.ctx.interrupts
        if interrupts.reason is not None:
            raise self._interrupted()
        task = interrupts.task = asyncio.current_task()
        try:
            return await raws.__anext__()
        except asyncio.CancelledError:
            if interrupts.ours(task):
                raise self._interrupted() from None
            raise
        finally:
            interrupts.task = None

    # ---- the run ----
    async def run(self) -> AsyncGenerator[Delta, None]:
        """Yield client-ready deltas; the last has finish_reason set. Raises RouterError before the first delta
        (the app answers with its status) and RouterError/WorkerError after (the app sends an error event).

        Places the request and runs it, round after round, each on a fresh ticket closed here exactly once. A
        worker that never accepted the request is left out of the next placement: for good when it refused the
        connection, for this round only when it was merely slow to accept (if nothing else is left the request
        waits on it again, within its deadline). A worker that died with the request is left out and the request
        migrated: the next round gets the prompt plus the tokens streamed so far. One generator from the worker
        stream's reader to the client: each streamed token passes three async-generator hops (two before D)."""
        dead: set[str] = set()
        slow: set[str] = set()
        lost: Migrate | None = None  # the last worker failure that moved the request
        movers = getattr(self.placement, "movers", None)
        if movers is not None:
            movers.add(self.req.request_id, self.moves)
        self.deadline.arm()
        accept = self.output.accept
        try:
            while True:
                if self.deadline.expired:
                    raise self.deadline.error()
                self.ctx.interrupts.reset()
                self._done = len(self.output.token_ids)
                self.ctx.handoff_since = None
                if self._done:
                    self.output.catch_up()
                if self._left <= 0:  # every token is out, only the finish was lost with the worker
                    yield self.output.accept(Delta("", [], "length"))
                    return
                ticket = self._place(dead, slow, lost)
                if ticket is None:
                    continue
                try:
                    if ticket.waits:  # decodes moved off this prefill's worker: their tail prefills go first
                        await wait_moves(ticket.waits, ticket.wait_s)
                    async with aclosing(self._attempts(ticket, dead)) as raws:
                        while True:
                            try:
                                raw = await self._next(raws)
                            except StopAsyncIteration:
                                break
                            out = accept(raw)
                            if out.finish_reason is not None:
                                self._finished(out)
                                yield out
                                return  # leaving closes D's stream (a stop string's hit: vLLM aborts it)
                            yield out
                    raise upstream_failed("worker stream ended without a finish_reason")
                except Retry as r:
                    (dead if r.dead else slow).add(r.url)
                except Moved as mv:  # not a failure: no worker error, not against the migration limit
                    self.metrics.moves.inc()
                    log.info("request %s: moved off %s after %d token(s)", self.req.request_id, mv.url,
                             len(self.output.token_ids))
                except Migrate as m:
                    dead.add(m.url)
                    lost = m
                    self._migrated(m)
                finally:
                    ticket.close()
        finally:
            self.deadline.cancel()
            self.moves.release()  # a move that came too late: the request ended first
            if movers is not None:
                movers.remove(self.req.request_id, self.moves)

    def _place(self, dead: set[str], slow: set[str], lost: Migrate | None) -> PlacementTicket | None:
        """This round's ticket: a move's, or a new placement without the workers left out; None: try again (only
        slow workers were left out: wait on them rather than fail)."""
        moved = self.moves.take()
        if moved is not None:
            self.output.gap_since = self.moves.at
            move_span(moved, self.moves.at)
            ticket = moved
        else:
            try:
                ticket = self.placement.choose(self._prompt, frozenset(dead | slow), self.req.request_id, self._left,
                                               self.domain)
            except RouterError as e:
                if e.status == 503 and slow:
                    slow.clear()
                    return None
                if e.status == 503 and lost is not None:
                    err = upstream_failed(f"{lost.role} worker {lost.url} failed with the request ({lost.reason}) "
                                          f"and no other worker can take it over: {e.message}")
                    log.warning("request %s: %s", self.req.request_id, err.message)
                    raise err from None
                raise
        self.ticket = self.output.ticket = ticket
        ticket.tokens_before = self._done
        return ticket

    def _migrated(self, m: Migrate) -> None:
        self.migrations += 1
        if self.migrations > self.migration_limit:
            raise upstream_failed(f"the request lost its worker {self.migrations} times, more than the migration "
                                  f"limit of {self.migration_limit} (router --migration-limit); last: {m.reason}",
                                  "migration_limit") from None
        self.metrics.migrations.labels(m.role).inc()
        log.warning("request %s: %s worker %s failed after %d token(s) (%s); migrating it (%d of at most %d)",
                    self.req.request_id, m.role, m.url, len(self.output.token_ids), m.reason, self.migrations,
                    self.migration_limit)

    def _attempts(self, ticket: PlacementTicket, dead: set[str]) -> AsyncGenerator[Delta, None]:
        """One ticket's attempts as one stream of raw deltas: P then D, or the whole request on one worker."""
        return self._whole(ticket) if self.colocated or ticket.prefill is None else self._pd(ticket, dead)

    def _finished(self, out: Delta) -> None:
        if self.attempt is not None:
            self.attempt.end("ok", f"finished: {out.finish_reason}")

    def _attempt(self, ticket: PlacementTicket, kind: str, role: str) -> Attempt:
        w = ticket.prefill if kind == "prefill" else ticket.decode
        assert w is not None
        if kind == "prefill":
            self.t.prefill_worker = w.url
        else:
            self.t.decode_worker = w.url
        self.attempt = Attempt(self.ctx, ticket, w, role, kind)
        return self.attempt

    def _relay(self) -> bool:
        """The worker's plain events may go to the client as bytes once its text is the output's: nothing to cut
        (no router-side stop strings) and the answer needs no per-token transform (``passthrough``)."""
        return self.passthrough and not self.output.stopper.stops

    def _sync(self, own_text: bool) -> TextSync | None:
        """An attempt that continues the output (D after P's token, a migrated attempt) takes the router's text
        only until its own is settled (.textsync); with stop strings every token keeps the router's text, whose
        per-token pieces cut a multi-token delta at the token that completes the stop string (``Output.accept``)."""
        return TextSync() if own_text and not self.output.stopper.stops else None

    def _whole(self, ticket: PlacementTicket) -> AsyncGenerator[Delta, None]:
        """The whole request on ticket.decode: its stream as it is (no generator of its own in between), or, for
        ``prompt_logprobs`` (which vLLM does not stream), one unstreamed answer."""
        role = "colocated" if self.colocated else "decode"
        if "prompt_logprobs" in self.req.sampling and not self._done:
            return self._scored(self._attempt(ticket, "scored", role))
        own_text = self._done > 0  # a migrated attempt: the router's detokenizer carries the text on
        return self._attempt(ticket, "whole", role).deltas(
            self._body(self._prompt, self._left, True, whole_output=True), own_text, answered=self._done > 0,
            relay=self._relay(),
            keep_prompt_logprobs=not self._done, sync=self._sync(own_text))

    async def _scored(self, attempt: Attempt) -> AsyncGenerator[Delta, None]:
        t = self.t
        now = time.perf_counter()
        if t.dispatch is None:
            t.dispatch = now
        t.d_sent = now
        resp = await attempt.complete(self._body(self.prompt_ids, self.max_tokens, False))
        t.d_first = t.d_end = time.perf_counter()
        attempt.ticket.prefill_done()
        c0 = (resp.get("choices") or [{}])[0]
        self.output.prompt_logprobs = c0.get("prompt_logprobs")
        yield Delta(c0.get("text") or "", list(c0.get("token_ids") or []), c0.get("finish_reason") or "length",
                    c0.get("stop_reason"), c0.get("logprobs"))

    async def _early_params(self, ticket: PlacementTicket) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(P's extra, D's) ``kv_transfer_params`` for an early hand-off on this ticket (:mod:`.early_dispatch`), or
        None: the serial hand-off (early dispatch off, P's engine not known yet, P's token the whole output, or
        sampling under which D's first token need not be P's). Both carry :data:`CONTINUE` where D continues after
        P's first token (the data plane's choice for this P and sampling)."""
        if self.early is None or ticket.prefill is None or ticket.decode is None:
            return None
        if self.first_from_prefill and self._left < 2:
            return None
        continues = self.first_from_prefill and self.early.continues(ticket.prefill.url, self.req.sampling)
        if not early_allowed(self.req.sampling, self.first_from_prefill, continues):
            return None
        early = await self.early.params(ticket.prefill.url, len(self._prompt))
        if early is None or not continues:
            return early
        return {**early[0], CONTINUE: True}, {**early[1], CONTINUE: True}

    async def _prefill(self, ticket: PlacementTicket, p: Attempt, body: dict[str, Any]) -> tuple[dict, Any]:
        """P's call: its answer's first choice and its ``kv_transfer_params`` (the book learns P's engine from them;
        a P that failed is forgotten)."""
        now = time.perf_counter()
        if self.t.dispatch is None:
            self.t.dispatch = now
        self.t.p_sent = now
        try:
            resp = await p.complete(body, streamed_client=self.req.stream)
        except (Retry, Migrate):
            if self.early is not None:
                self.early.forget(p.worker.url)
            raise
        self.t.p_done = time.perf_counter()
        self.ctx.handoff_since = asyncio.get_running_loop().time()
        ticket.prefill_done()
        c0 = self._prefill_answer(p, resp)
        kvp = resp.get("kv_transfer_params")
        if self.early is not None:
            self.early.learn(p.worker.url, kvp)
        transfer_stats(resp, self.t)
        if not self._done:
            self.output.prompt_logprobs = c0.get("prompt_logprobs")
        return c0, kvp

    def _prefill_body(self) -> dict[str, Any]:
        body = self._body(self._prompt, 1, False)
        if not self.first_from_prefill:  # P's token is thrown away: no grammar for P to compile
            body.pop("structured_outputs", None)
            body.pop("response_format", None)
        if not (self.first_from_prefill and self._left == 1):  # else P's token is the whole output: no lease
            body["kv_transfer_params"] = dict(self.prefill_kv_params)
        return body

    async def _pd(self, ticket: PlacementTicket, exclude: set[str]) -> AsyncGenerator[Delta, None]:
        """P's one-token prefill, then D's stream (the hand-off); early dispatch where it applies."""
        early = await self._early_params(ticket)
        if early is not None:
            async with aclosing(self._pd_early(ticket, exclude, early)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        p = self._attempt(ticket, "prefill", "prefill")
        c0, kvp = await self._prefill(ticket, p, self._prefill_body())
        if not self.first_from_prefill:  # D gets the prompt alone and produces the whole output itself
            kvp = await self._decode_params(ticket, kvp, c0.get("finish_reason"))
            d_body = self._body(self._prompt, self._left, True, computes_prompt=False, whole_output=True)
        else:
            first = self._first_token(p, c0)
            if first.finish_reason is not None:
                self.metrics.handoffs.labels("skipped").inc()
                yield first
                return
            t1 = first.token_ids[0]
            kvp = await self._decode_params(ticket, kvp, c0.get("finish_reason"))
            yield first
            d_body = self._body(self._prompt + [t1], self._left - 1, True, computes_prompt=False)
        self.metrics.handoffs.labels("kv" if isinstance(kvp, dict) else "no_kv").inc()
        if isinstance(kvp, dict):
            d_body["kv_transfer_params"] = kvp
        async with aclosing(self._hand_to_decode(ticket, exclude, d_body)) as deltas:
            async for delta in deltas:
                yield delta

    def _first_token(self, p: Attempt, c0: dict[str, Any]) -> Delta:
        """P's first token as the client's first delta; finished (``finish_reason`` set) when it ends the output
        (a stop, or the last token asked). A prefill that ended otherwise than by length is P's failure (raised)."""
        t1, finish = c0["token_ids"][0], c0.get("finish_reason")
        first = Delta(self.output.delta([t1], c0, True).text, [t1], logprobs=c0.get("logprobs"))
        if finish == "stop" or self._left == 1:
            first.finish_reason, first.stop_reason = finish or "length", c0.get("stop_reason")
        elif finish != "length":
            p.end("error", f"finished with {finish!r} after one token")
            raise upstream_failed(f"prefill worker {p.worker.url} finished with {finish!r} after one token")
        return first

    async def _pd_early(self, ticket: PlacementTicket, exclude: set[str],
                        early: tuple[dict[str, Any], dict[str, Any]]) -> AsyncGenerator[Delta, None]:
        """P's prefill and D's request at once (:mod:`.early_dispatch`). P's first token goes to the client as soon
        as P answers; D's stream follows from its second token (D continues after P's, or regenerates it and its
        first must be P's). D failing, diverging or unable to continue before it streamed anything: the serial
        hand-off (prompt + [t1], P's lease) takes over."""
        p = self._attempt(ticket, "prefill", "prefill")
        body = self._prefill_body()
        after_first = self.first_from_prefill
        continues = early[1].get(CONTINUE) is True  # (_early_params: D continues after P's token)
        body["kv_transfer_params"] = {**body.get("kv_transfer_params", {}), **early[0]}
        expect: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        d, d_deltas = self._early_decode(ticket, early[1], expect if after_first else None, continues)
        d_first = asyncio.ensure_future(d_deltas.__anext__())
        self.metrics.handoffs.labels("early").inc()
        try:
            c0, kvp = await self._prefill(ticket, p, body)
            if d.started:
                self.ctx.handoff_since = None
            if after_first:
                first = self._first_token(p, c0)
                if first.finish_reason is not None:  # the output ends with P's token: D is closed below
                    yield first
                    return
                t1 = first.token_ids[0]
                expect.set_result(t1)
                yield first
            elif await self._decode_params(ticket, kvp, c0.get("finish_reason")) is None:
                # P kept nothing for D (MooncakeConnector: its token did not end by length): D would wait for KV that
                # never comes, so it gets the serial request instead (it computes the prompt)
                await self._close_early(d_first, d_deltas)
                async with aclosing(self._serial_after_early(ticket, exclude, c0, kvp)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            self.attempt = d
            try:
                delta = await self._early_first(d_first)
            except (Diverged, Retry, Migrate) as e:
                log.info("request %s: early hand-off to %s gave way to the serial one (%s)", self.req.request_id,
                         d.worker.url, e)
                self.metrics.handoffs.labels("early_fallback").inc()
                await self._close_early(d_first, d_deltas)
                async with aclosing(self._serial_after_early(ticket, exclude, c0, kvp)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            yield delta
            async for delta in d_deltas:
                yield delta
        finally:
            if not expect.done():
                expect.cancel()
            await self._close_early(d_first, d_deltas)

    def _early_decode(self, ticket: PlacementTicket, kv_params: dict[str, Any], expect: asyncio.Future[int] | None,
                      continues: bool = False) -> tuple[Attempt, AsyncGenerator[Delta, None]]:
        """D's attempt of an early hand-off and its (not yet started) stream: the prompt alone, all that is left of
        ``max_tokens`` (a D that continues after P's first token counts it: pdserve.vllm.continuation); ``expect``:
        P's first token, which D's first must equal, or, ``continues``, which D's stream follows (None: D's stream
        is the output)."""
        after_first = expect is not None
        own_text = after_first or self._done > 0
        d_body = self._body(self._prompt, self._left, True, computes_prompt=False, whole_output=not after_first)
        d_body["kv_transfer_params"] = kv_params
        assert ticket.decode is not None
        self.t.decode_worker = ticket.decode.url
        d = Attempt(self.ctx, ticket, ticket.decode, "decode", "decode")
        return d, d.deltas(d_body, own_text, answered=own_text, relay=self._relay(), keep_prompt_logprobs=not own_text,
                           sync=self._sync(own_text), skip_first=None if continues else expect,
                           after_first=expect if continues else None)

    async def _early_first(self, d_first: asyncio.Future[Delta]) -> Delta:
        """D's first delta after P's answer, within the hand-off deadline (as a serial D's first event)."""
        ctx = self.ctx
        if ctx.handoff_timeout_s is None or ctx.handoff_since is None:
            return await d_first
        try:
            return await within(d_first, ctx.handoff_since + ctx.handoff_timeout_s)
        except asyncio.TimeoutError:
            ctx.metrics.deadlines.labels("handoff").inc()
            raise deadline_exceeded(f"the decode worker did not start within the hand-off deadline of "
                                    f"{ctx.handoff_timeout_s:g} s after the prefill (router --handoff-timeout-s)",
                                    "handoff_timeout") from None

    @staticmethod
    async def _close_early(d_first: asyncio.Future[Delta], d_deltas: AsyncGenerator[Delta, None]) -> None:
        """End D's early stream: its pending first read cancelled, then the stream closed (vLLM aborts the request;
        its connector's wait for P ends by P's answer or its bound, and frees D's blocks)."""
        if not d_first.done():
            d_first.cancel()
        try:
            await d_first
        except BaseException:  # its outcome is the caller's no more (cancelled, failed, diverged)
            pass
        await d_deltas.aclose()

    async def _serial_after_early(self, ticket: PlacementTicket, exclude: set[str], c0: dict[str, Any], kvp: Any
                                  ) -> AsyncGenerator[Delta, None]:
        """The serial hand-off after an early one gave way: D gets prompt + [t1] with P's kv_transfer_params (what D
        read already is in its prefix cache), or, where D regenerates the first token, the prompt alone."""
        if self.first_from_prefill:
            d_body = self._body(self._prompt + [c0["token_ids"][0]], self._left - 1, True, computes_prompt=False)
        else:
            kvp = await self._decode_params(ticket, kvp, c0.get("finish_reason"))
            d_body = self._body(self._prompt, self._left, True, computes_prompt=False, whole_output=True)
        if isinstance(kvp, dict):
            d_body["kv_transfer_params"] = kvp
        async with aclosing(self._hand_to_decode(ticket, exclude, d_body)) as deltas:
            async for delta in deltas:
                yield delta

    def _prefill_answer(self, p: Attempt, resp: dict) -> dict[str, Any]:
        try:
            c0 = resp["choices"][0]
            ids = c0.get("token_ids")
            if not isinstance(ids, list) or len(ids) != 1 or not isinstance(c0.get("text") or "", str):
                raise ValueError(f"expected one token id, got token_ids={ids!r}")
        except (KeyError, IndexError, TypeError, ValueError) as e:
            self.metrics.worker_errors.labels("prefill", "protocol").inc()
            p.end("error", f"unexpected completion: {e}")
            raise upstream_failed(f"prefill worker {p.worker.url} answered an unexpected completion: {e}") from None
        p.end("ok", "prefilled")
        return c0

    async def _decode_params(self, ticket: PlacementTicket, kvp: Any, finish: str | None) -> Any:
        if self.decode_kv_params is None:
            return kvp
        prefill = ticket.prefill.url if ticket.prefill is not None else "?"
        try:
            params = self.decode_kv_params(prefill, kvp, finish)
            return await params if inspect.isawaitable(params) else params
        except RouterError:
            self.metrics.worker_errors.labels("prefill", "protocol").inc()
            raise

    async def _hand_to_decode(self, ticket: PlacementTicket, exclude: set[str], d_body: dict[str, Any]
                              ) -> AsyncGenerator[Delta, None]:
        """Run D's stream; a D that never accepted the decode is replaced (same P, P's blocks still leased); with
        no D left the request migrates (the whole of it on another worker, P included: it decodes locally)."""
        tries: set[str] = set()
        after_first = self.first_from_prefill
        own_text = after_first or self._done > 0  # the router's detokenizer carries the text on
        while True:
            try:
                async with aclosing(self._attempt(ticket, "decode", "decode").deltas(
                        d_body, own_text, answered=own_text, relay=self._relay(),
                        keep_prompt_logprobs=not own_text, sync=self._sync(own_text))) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            except Retry as r:  # D unreachable: P's blocks are still leased, move only the decode
                tries.add(r.url)
                try:
                    ticket.replace_decode(frozenset(exclude | tries))
                except RouterError as e:
                    raise Migrate(r.url, "decode", e.message) from None
