"""Workloads: what to send and when, independent of how it is sent (see :mod:`pdserve.bench.runner`).

A workload is a list of :class:`Session`s. A session starts at its ``arrival_s`` (open loop) or when a client
slot frees up (closed loop), then sends its turns one after another: each turn waits for the previous one to
finish, plus ``think_s``. A plain request is a one-turn session. Three generators:

- :func:`trace_workload`: a Mooncake-format trace (:mod:`pdserve.bench.traces`), one request per row.
- :func:`synthetic_workload`: Poisson or fixed-rate arrivals with input/output length distributions.
- :func:`agent_workload`: multi-turn agent sessions: a shared system prompt, then per turn the model's answer and
  a tool result are appended, so each turn's prompt extends the previous one (prefix-cache friendly, growing).

A spec string picks one from the command line: ``KIND[:key=value,...]``, e.g.
``trace:input_scale=0.1,rate=0.8,requests=60`` or ``poisson:rate=2,input=100,output=32,requests=50``
(:func:`parse_spec`, :func:`build_workload`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .traces import (
    TOKEN_LOW,
    TraceError,
    TraceScale,
    conversation_rows,
    default_trace,
    load_trace,
    prompt_ids,
    scale_rows,
    trace_summary,
)


@dataclass
class Turn:
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class Session:
    """One or more turns sent in order; ``arrival_s`` from the workload's start (ignored in closed loop)."""

    index: int
    arrival_s: float
    turns: list[Turn]
    think_s: float = 0.0


@dataclass
class Workload:
    name: str
    sessions: list[Session]
    concurrency: int | None = None  # closed loop with this many clients; None = open loop (arrival times)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def offered_rate(self) -> float | None:
        """Mean request arrival rate (open loop, one-turn sessions), else None (closed loop, multi-turn)."""
        if self.concurrency is not None or len(self.sessions) < 2 or any(len(s.turns) != 1 for s in self.sessions):
            return None
        span = self.sessions[-1].arrival_s - self.sessions[0].arrival_s
        if span <= 0:
            return None
        return (self.num_requests - len(self.sessions[-1].turns)) / span


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return [int(t) for t in rng.integers(TOKEN_LOW, vocab_size, size=n, dtype=np.int64)]


def _lengths(rng: np.random.Generator, mean: int, dist: str, n: int, lo: int = 1, hi: int | None = None) -> list[int]:
    """``n`` lengths with mean ~``mean``: fixed, uniform (50%..150%), exponential, or lognormal (sigma 0.5)."""
    if dist == "fixed":
        vals = np.full(n, float(mean))
    elif dist == "uniform":
        vals = rng.uniform(0.5 * mean, 1.5 * mean, size=n)
    elif dist == "exp":
        vals = rng.exponential(mean, size=n)
    elif dist == "lognormal":
        sigma = 0.5
        vals = rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, size=n)
    else:
        raise TraceError(f"length distribution {dist!r} unknown; use fixed, uniform, exp or lognormal")
    out = np.maximum(lo, np.rint(vals)).astype(int)
    if hi is not None:
        out = np.minimum(out, hi)
    return [int(v) for v in out]


def _arrivals(rng: np.random.Generator, rate: float, n: int, process: str) -> list[float]:
    if rate <= 0:
        raise TraceError(f"rate={rate}: use requests per second > 0")
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n)
        gaps[0] = 0.0
    elif process == "fixed":
        gaps = np.full(n, 1.0 / rate)
        gaps[0] = 0.0
    else:
        raise TraceError(f"arrival process {process!r} unknown; use poisson or fixed")
    return [float(t) for t in np.cumsum(gaps)]


def trace_workload(path: str = "", start: int = 0, requests: int = 100,
                   scale: TraceScale = TraceScale(), vocab_size: int = 32000, seed: int = 0,
                   concurrency: int | None = None, name: str = "trace", reuse: float | None = None) -> Workload:
    """Rows ``start ..`` of a trace, consecutive, or with ``reuse`` (0-1) conversations' turns picked from every row
    after ``start`` (:func:`~pdserve.bench.traces.conversation_rows`, prefix reuse near that block ratio)."""
    path = path or str(default_trace())  # "" = $PDSERVE_TRACE or the packaged conversation trace
    if reuse is not None and not 0 <= reuse < 1:
        raise TraceError(f"reuse={reuse!r}: give the block-level prefix reuse to aim at, 0 <= reuse < 1 (e.g. 0.32)")
    if reuse is None:
        rows = load_trace(path, start=start, limit=requests)
    else:
        rows = conversation_rows(load_trace(path, start=start), requests, reuse)
    scaled = scale_rows(rows, scale)
    sessions = [Session(r.index, r.arrival_s, [Turn(prompt_ids(r, scale.block_tokens, vocab_size, seed),
                                                    r.output_length)]) for r in scaled]
    info = {"kind": "trace", "path": str(path), "start": start, "reuse": reuse, **trace_summary(scaled),
            "block_tokens": scale.block_tokens, "scale": scale.__dict__}
    return Workload(name, sessions, concurrency, info)


def synthetic_workload(rate: float = 1.0, requests: int = 50, input: int = 128, output: int = 32,
                       input_dist: str = "fixed", output_dist: str = "fixed", arrival: str = "poisson",
                       max_model_len: int | None = None, vocab_size: int = 32000, seed: int = 0,
                       concurrency: int | None = None, name: str = "synthetic") -> Workload:
    rng = np.random.default_rng(seed)
    outs = _lengths(rng, output, output_dist, requests)
    ins = _lengths(rng, input, input_dist, requests)
    if max_model_len is not None:
        outs = [min(o, max_model_len - 1) for o in outs]
        ins = [min(i, max_model_len - o) for i, o in zip(ins, outs)]
    times = _arrivals(rng, rate, requests, arrival)
    sessions = [Session(i, t, [Turn(_tokens(rng, n, vocab_size), o)]) for i, (t, n, o) in
                enumerate(zip(times, ins, outs))]
    info = {"kind": "synthetic", "rate": rate, "arrival": arrival, "input_mean": float(np.mean(ins)),
            "output_mean": float(np.mean(outs)), "input_dist": input_dist, "output_dist": output_dist,
            "requests": requests}
    return Workload(name, sessions, concurrency, info)


def agent_workload(sessions: int = 8, turns: int = 4, rate: float = 0.5, system: int = 256, user: int = 64,
                   tool: int = 192, output: int = 32, think_s: float = 0.0, max_model_len: int | None = None,
                   vocab_size: int = 32000, seed: int = 0, concurrency: int | None = None,
                   name: str = "agent") -> Workload:
    """Agent sessions. Turn 1: system + user task. Turn k+1: turn k's prompt + an assistant block of ``output``
    tokens (standing in for the model's tool call; the real answer is not fed back, so the prompts are fixed in
    advance and identical across configurations) + a ``tool``-token tool result. Every session shares the
    system prompt; contexts grow by ``output + tool`` tokens per turn and stop growing at ``max_model_len``."""
    rng = np.random.default_rng(seed)
    sys_ids = _tokens(np.random.default_rng([seed, 7]), system, vocab_size)
    starts = _arrivals(rng, rate, sessions, "poisson")
    out: list[Session] = []
    for s in range(sessions):
        ctx = sys_ids + _tokens(rng, user, vocab_size)
        ts: list[Turn] = []
        for _ in range(turns):
            if max_model_len is not None and len(ctx) + output > max_model_len:
                break
            ts.append(Turn(list(ctx), output))
            ctx = ctx + _tokens(rng, output, vocab_size) + _tokens(rng, tool, vocab_size)
        out.append(Session(s, starts[s], ts, think_s))
    info = {"kind": "agent", "sessions": sessions, "turns": turns, "rate": rate, "system": system, "user": user,
            "tool": tool, "output": output, "requests": sum(len(s.turns) for s in out),
            "input_mean": float(np.mean([len(t.prompt_ids) for s in out for t in s.turns]))}
    return Workload(name, out, concurrency, info)


# --------------------------------------------------------------------------- spec strings

_TRACE_SCALE_KEYS = {"input_scale", "output_scale", "time_scale", "rate", "max_input", "max_output", "min_output",
                     "spread"}
_KINDS: dict[str, Callable[..., Workload]] = {"trace": trace_workload, "poisson": synthetic_workload,
                                              "fixed": synthetic_workload, "agent": agent_workload}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"trace:rate=1,requests=40"`` -> ``("trace", {"rate": "1", "requests": "40"})``."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in _KINDS:
        raise TraceError(f"workload kind {kind!r} unknown; use one of {sorted(_KINDS)} "
                         "(e.g. trace:input_scale=0.1,rate=1 or poisson:rate=2,input=128)")
    params: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise TraceError(f"workload option {item!r}: write key=value")
        params[key.strip()] = value.strip()
    return kind, params


def _num(v: str) -> int | float:
    try:
        return int(v)
    except ValueError:
        return float(v)


def build_workload(spec: str, vocab_size: int = 32000, max_model_len: int | None = None,
                   overrides: dict[str, Any] | None = None) -> Workload:
    """A workload from a spec string; ``overrides`` (e.g. ``{"rate": 2.0}``) win over the spec's values."""
    kind, raw = parse_spec(spec)
    params: dict[str, Any] = {k: (v if k in ("path", "input_dist", "output_dist", "arrival", "name") else _num(v))
                              for k, v in raw.items()}
    params.update(overrides or {})
    params.setdefault("name", spec)
    params["vocab_size"] = vocab_size
    if kind == "trace":
        scale_kw = {k: params.pop(k) for k in list(params) if k in _TRACE_SCALE_KEYS}
        if "spread" in scale_kw:
            scale_kw["spread"] = bool(scale_kw["spread"])
        scale = TraceScale(max_model_len=max_model_len, **scale_kw)
        wl = _call(trace_workload, kind, params, scale=scale)
    else:
        if kind == "fixed":
            params.setdefault("arrival", "fixed")
        wl = _call(_KINDS[kind], kind, dict(params, max_model_len=max_model_len))
    wl.info["spec"] = spec
    if overrides:
        wl.info["overrides"] = dict(overrides)
    return wl


def _call(fn: Callable[..., Workload], kind: str, params: dict[str, Any], **extra: Any) -> Workload:
    import inspect

    allowed = set(inspect.signature(fn).parameters) | (_TRACE_SCALE_KEYS if kind == "trace" else set())
    unknown = set(params) - allowed
    if unknown:
        raise TraceError(f"{kind} workload: unknown option(s) {sorted(unknown)}; known: {sorted(allowed - {'scale'})}")
    if "concurrency" in params and params["concurrency"] is not None:
        params["concurrency"] = int(params["concurrency"])
    return fn(**params, **extra)
