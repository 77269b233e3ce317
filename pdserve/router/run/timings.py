"""One request's phase timestamps (:class:`Timings`, reported in the ``X-Pdserve-Timings`` answer and the router's
metrics) and the KV transfer figures D's connector reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..workers.client import Wait


@dataclass
class Timings:
    """Monotonic timestamps (perf_counter seconds) of one request's phases, reported in milliseconds as:

    queue_ms: arrival -> first worker request sent (body parse, chat template, tokenization, placement).
    prefill_ms: P's round trip (request sent -> its one-token answer parsed).
    kv_transfer_bytes / kv_transfer_ms: what D's connector reports (``kv_transfer_params.pdserve``); None
        when the worker does not say (vLLM 0.32 omits kv_transfer_params from streamed answers).
    handoff_ms: P's answer -> D's first token at the router (includes D's queue, KV fetch, first step).
    ttft_ms: arrival -> first token known to the router (t1 from P in disaggregated mode).
    tpot_ms: (last token - first token) / (tokens - 1); None below two tokens.
    decode_ms: D (or the colocated worker) request sent -> its last token.
    e2e_ms: arrival -> final chunk / response built.
    client_wait_ms: time spent in writes to the client (streamed answers: ``StreamResponse.write``, which waits
        when the client reads slower than the router sends).
    relayed_tokens: tokens passed to the client as the worker's bytes (:mod:`.relay`), not through the per-token
        path.
    router_overhead_ms: e2e minus the time spent awaiting workers and the client (parsing, tokenizing,
        detokenizing, stop matching, JSON/SSE, event-loop scheduling, waits for a core).
    """

    arrive: float
    mode: str = "disaggregated"
    dispatch: float | None = None
    p_sent: float | None = None
    p_done: float | None = None
    d_sent: float | None = None
    d_first: float | None = None
    d_end: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    end: float | None = None
    tokens: int = 0
    relayed: int = 0  # of tokens, those the relay passed through
    prompt_tokens: int = 0
    kv_bytes: int | None = None
    kv_ms: float | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    wait: Wait = field(default_factory=Wait)
    client: Wait = field(default_factory=Wait)  # awaiting writes to the client

    def report(self) -> dict[str, Any]:
        end = self.end if self.end is not None else time.perf_counter()

        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1000.0, 3)

        tpot = None
        if self.tokens >= 2 and self.first_token is not None and self.last_token is not None:
            tpot = round((self.last_token - self.first_token) * 1000.0 / (self.tokens - 1), 3)
        e2e = (end - self.arrive) * 1000.0
        return {
            "mode": self.mode,
            "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
            "queue_ms": ms(self.arrive, self.dispatch),
            "prefill_ms": ms(self.p_sent, self.p_done),
            "kv_transfer_bytes": self.kv_bytes,
            "kv_transfer_ms": self.kv_ms,
            "handoff_ms": ms(self.p_done, self.d_first),
            "ttft_ms": ms(self.arrive, self.first_token),
            "tpot_ms": tpot,
            "decode_ms": ms(self.d_sent, self.d_end),
            "e2e_ms": round(e2e, 3),
            "client_wait_ms": round(self.client.seconds * 1000.0, 3),
            "router_overhead_ms": round(max(0.0, e2e - (self.wait.seconds + self.client.seconds) * 1000.0), 3),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "relayed_tokens": self.relayed,
        }


def transfer_stats(obj: Any, t: Timings) -> None:
    """Read KV transfer bytes/ms where the pdserve connector reports them: D's ``kv_transfer_params`` =
    ``{"pdserve": {"bytes", "ms", "blocks", "ok"}}`` (set in request_finished). vLLM 0.32 puts
    kv_transfer_params only in non-streaming answers, so for streamed decodes they stay None."""
    if not isinstance(obj, dict):
        return
    kvp = obj.get("kv_transfer_params")
    stats = kvp.get("pdserve") if isinstance(kvp, dict) else None
    if not isinstance(stats, dict):
        return
    b, m = stats.get("bytes"), stats.get("ms")
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        t.kv_bytes = int(b)
    if isinstance(m, (int, float)) and not isinstance(m, bool):
        t.kv_ms = float(m)
