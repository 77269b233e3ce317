"""Send a :class:`~pdserve.bench.workload.Workload` to any OpenAI-compatible server and record every request.

Open loop: each session starts at its arrival time, whether or not earlier ones finished (the server's queueing
shows up in TTFT). Closed loop (``workload.concurrency``): that many clients each send a session, wait for it to
finish, and take the next. Turns within a session go in order. Prompts are token ids on ``/v1/completions``
(vLLM and the pdserve router both accept a list of ints as ``prompt``), streamed with usage, greedy, and with
``ignore_eos`` so every request produces exactly its ``max_tokens``.

Bounds: ``max_requests`` cuts the workload (whole sessions, in order) before it starts; ``duration_s`` stops
sending new requests after that many seconds, and whatever is still in flight ``drain_s`` later is cancelled and
recorded as an error. A one-line progress bar goes to stderr.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp

from .client import stream_completion
from .metrics import RequestRecord
from .workload import Session, Workload


@dataclass
class RunOptions:
    url: str
    model: str
    timings: bool = True  # ask the pdserve router for per-request phase timings (plain vLLM ignores it)
    max_requests: int | None = None
    duration_s: float | None = None
    drain_s: float = 120.0
    request_timeout_s: float = 600.0
    warmup: int = 1  # short requests sent (and not recorded) before the run
    progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=lambda: {"temperature": 0, "ignore_eos": True})


@dataclass
class RunResult:
    workload: str
    records: list[RequestRecord]
    t0: float  # monotonic time the run started; record times are relative to this in JSON
    wall_s: float  # first send -> last end
    truncated: int = 0  # requests left out by max_requests / duration_s

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "wall_s": self.wall_s, "truncated": self.truncated,
                "records": [r.to_dict(self.t0) for r in self.records]}


def cut_sessions(sessions: list[Session], max_requests: int | None) -> tuple[list[Session], int]:
    """Whole sessions in order while their turns fit ``max_requests``; also the number of turns left out."""
    if max_requests is None:
        return sessions, 0
    kept: list[Session] = []
    n = 0
    for s in sessions:
        if n + len(s.turns) > max_requests:
            break
        kept.append(s)
        n += len(s.turns)
    return kept, sum(len(s.turns) for s in sessions) - n


class Progress:
    """``[bench] NAME 12/40 ok 11 err 1 in flight 3 23.4s`` on one stderr line (a new line every 10 s when
    stderr is not a terminal)."""

    def __init__(self, name: str, total: int, out: TextIO = sys.stderr, enabled: bool = True) -> None:
        self.name, self.total, self.out, self.enabled = name, total, out, enabled
        self.done = self.errors = self.inflight = 0
        self.t0 = time.monotonic()
        self.tty = hasattr(out, "isatty") and out.isatty()
        self._last = 0.0

    def line(self) -> str:
        width = 20
        filled = int(width * self.done / self.total) if self.total else width
        bar = "#" * filled + "." * (width - filled)
        return (f"[bench] {self.name} [{bar}] {self.done}/{self.total} ok {self.done - self.errors} "
                f"err {self.errors} in flight {self.inflight} {time.monotonic() - self.t0:.1f}s")

    def update(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if force or now - self._last >= 0.5:
                self.out.write("\r" + self.line())
                self.out.flush()
                self._last = now
        elif force or now - self._last >= 10.0:
            self.out.write(self.line() + "\n")
            self.out.flush()
            self._last = now

    def close(self) -> None:
        self.update(force=True)
        if self.enabled and self.tty:
            self.out.write("\n")
            self.out.flush()


async def _warmup(session: aiohttp.ClientSession, opts: RunOptions, n: int) -> None:
    for i in range(n):
        body = {"model": opts.model, "prompt": [1000 + i, 1001, 1002, 1003], "max_tokens": 2, **opts.extra_body}
        rec = await stream_completion(session, opts.url, body, timeout_s=opts.request_timeout_s, timings=False)
        if not rec.ok:
            raise RuntimeError(f"warm-up request to {opts.url} failed: {rec.error}")


async def run_workload(workload: Workload, opts: RunOptions) -> RunResult:
    sessions, truncated = cut_sessions(workload.sessions, opts.max_requests)
    total = sum(len(s.turns) for s in sessions)
    progress = Progress(workload.name, total, enabled=opts.progress)
    records: list[RequestRecord] = []
    stop_sending = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as http:
        await _warmup(http, opts, opts.warmup)
        t0 = time.monotonic()

        async def one_session(s: Session, delay_start: bool) -> None:
            if delay_start:
                await asyncio.sleep(max(0.0, t0 + s.arrival_s - time.monotonic()))
            for k, turn in enumerate(s.turns):
                if stop_sending.is_set():
                    return
                if k and s.think_s:
                    await asyncio.sleep(s.think_s)
                body = {"model": opts.model, "prompt": turn.prompt_ids, "max_tokens": turn.max_tokens,
                        **opts.extra_body}
                scheduled = time.monotonic() - t0
                progress.inflight += 1
                progress.update()
                try:
                    rec = await stream_completion(http, opts.url, body, timeout_s=opts.request_timeout_s,
                                                  timings=opts.timings)
                except asyncio.CancelledError:
                    records.append(RequestRecord(ok=False, start=time.monotonic(), session=s.index, turn=k,
                                                 scheduled_s=scheduled, error="cancelled at the run's time bound"))
                    progress.done += 1
                    progress.errors += 1
                    raise
                finally:
                    progress.inflight -= 1
                rec.session, rec.turn, rec.scheduled_s = s.index, k, round(scheduled, 6)
                if not rec.prompt_tokens:
                    rec.prompt_tokens = len(turn.prompt_ids)
                records.append(rec)
                progress.done += 1
                progress.errors += 0 if rec.ok else 1
                progress.update()
                if not rec.ok:
                    return  # a later turn's context would include an answer that never came

        if workload.concurrency is None:
            tasks = [asyncio.create_task(one_session(s, True)) for s in sessions]
        else:
            queue: asyncio.Queue[Session] = asyncio.Queue()
            for s in sessions:
                queue.put_nowait(s)

            async def client() -> None:
                while not queue.empty() and not stop_sending.is_set():
                    await one_session(queue.get_nowait(), False)

            tasks = [asyncio.create_task(client()) for _ in range(max(1, workload.concurrency))]

        async def ticker() -> None:
            while True:
                await asyncio.sleep(0.5)
                progress.update()

        tick = asyncio.create_task(ticker())
        try:
            if opts.duration_s is not None:
                done, pending = await asyncio.wait(tasks, timeout=opts.duration_s)
                if pending:
                    stop_sending.set()
                    done, pending = await asyncio.wait(pending, timeout=opts.drain_s)
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
            else:
                await asyncio.gather(*tasks)
        finally:
            tick.cancel()
            progress.close()
    sent = len(records)
    ends = [r.end for r in records if r.end is not None]
    wall = (max(ends) if ends else time.monotonic()) - t0
    return RunResult(workload.name, sorted(records, key=lambda r: r.start), t0, wall, truncated + total - sent)


def run(workload: Workload, opts: RunOptions) -> RunResult:
    """Blocking wrapper around :func:`run_workload`."""
    return asyncio.run(run_workload(workload, opts))
