"""Mooncake-format traces: load, scale, and turn hash ids into token-id prompts.

A trace row (one JSON object per line, as in Mooncake's FAST'25 traces) is::

    {"timestamp": 3000, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is the arrival in milliseconds, ``hash_ids`` name the prompt's 512-token blocks, chained so that two
rows sharing a leading run of ids share that many blocks of prefix. To replay a row we make one token block per
hash id, drawn from a random generator seeded with (seed, hash id), so equal ids give equal tokens in every row
and every run. The last block is usually partial (``input_length`` is not a multiple of 512): the prompt is the
concatenation cut at ``input_length``, so it is a prefix of that block's tokens.

Scaling (this machine cannot serve 12K-token prompts at trace rate): ``input_scale`` multiplies input lengths
*and* the block size (a block of 512 becomes ``round(512 * input_scale)`` tokens), which keeps the sharing
structure: what was a shared 512-token block is a shared smaller block. ``output_scale`` multiplies output
lengths, ``time_scale`` multiplies inter-arrival times (0.5 = twice as fast); ``rate`` instead rescales time so
the mean arrival rate over the selected rows is that many requests per second. Finally lengths are capped:
``max_output``, then the input to ``min(max_input, max_model_len - output)``.

Row choice: consecutive rows from ``start``, or (:func:`conversation_rows`, the workload's ``reuse=R``) later
turns of conversations with the earlier turn each extends, at a block-level prefix reuse near ``R``: a
conversation's next turn is 100-300 rows after its last in the conversation trace, so consecutive rows share
little beyond a one-block system prompt.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

TRACE_BLOCK_TOKENS = 512
TRACE_ENV = "PDSERVE_TRACE"
# Mooncake's FAST'25 "conversation" trace, shipped gzipped with the package (see data/README.md: source, licence)
PACKAGED_TRACE = Path(__file__).resolve().parent / "data" / "conversation_trace.jsonl.gz"
# Token ids are drawn from [TOKEN_LOW, vocab_size): clear of the special tokens every Llama/Qwen/SmolLM2
# tokenizer keeps at low ids.
TOKEN_LOW = 1000


class TraceError(ValueError):
    """A trace file or scaling option is wrong; the message says which and how to fix it."""


@dataclass(frozen=True)
class TraceRow:
    """One request of a Mooncake-format trace, as written in the file."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceScale:
    """How to fit a trace to this machine; see the module docstring for what each factor does."""

    input_scale: float = 1.0
    output_scale: float = 1.0
    time_scale: float = 1.0
    rate: float | None = None
    max_input: int | None = None
    max_output: int | None = None
    max_model_len: int | None = None
    min_output: int = 1
    spread: bool = False

    def __post_init__(self) -> None:
        for name in ("input_scale", "output_scale", "time_scale"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise TraceError(f"{name}={v!r}: use a factor > 0 (1 keeps the trace as is)")
        if self.rate is not None and not self.rate > 0:
            raise TraceError(f"rate={self.rate!r}: use requests per second > 0, or leave it unset")
        for name in ("max_input", "max_output", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise TraceError(f"{name}={v!r}: use a positive number of tokens, or leave it unset")
        if self.min_output < 1:
            raise TraceError(f"min_output={self.min_output!r}: a request generates at least 1 token")
        if self.max_model_len is not None and self.max_model_len < self.min_output + 1:
            raise TraceError(f"max_model_len={self.max_model_len} leaves no room for a prompt")

    @property
    def block_tokens(self) -> int:
        """Tokens per hash block after scaling (at least 1)."""
        return max(1, round(TRACE_BLOCK_TOKENS * self.input_scale))


def cpu_scale(rate: float | None, max_output: int = 24) -> TraceScale:
    """The conversation trace shrunk for a small CPU stack, as the conductor's benchmarks replay it: prompts x0.1 up
    to 1,500 tokens, outputs x0.25 up to ``max_output``, a 4,096-token context, at ``rate`` requests per second."""
    return TraceScale(input_scale=0.1, output_scale=0.25, max_input=1500, max_output=max_output, max_model_len=4096,
                      rate=rate)


@dataclass(frozen=True)
class ScaledRequest:
    """A trace row after scaling: arrival in seconds from the first row, lengths in tokens."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_row(obj: dict, where: str = "") -> TraceRow:
    """One JSON object -> :class:`TraceRow`, with a message naming the field when it is wrong."""
    try:
        ts = float(obj["timestamp"])
        inp = int(obj["input_length"])
        out = int(obj["output_length"])
        ids = tuple(int(h) for h in obj.get("hash_ids", ()))
    except KeyError as exc:
        raise TraceError(f"{where}missing field {exc.args[0]!r}: a Mooncake trace row has timestamp (ms), "
                         "input_length, output_length and hash_ids") from None
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}bad value ({exc}): timestamp is a number of ms, lengths are integers, "
                         "hash_ids a list of integers") from None
    if inp < 1 or out < 0:
        raise TraceError(f"{where}input_length={inp}, output_length={out}: need input >= 1 and output >= 0")
    if ids and len(ids) * TRACE_BLOCK_TOKENS < inp:
        raise TraceError(f"{where}{len(ids)} hash ids cover {len(ids) * TRACE_BLOCK_TOKENS} tokens but "
                         f"input_length is {inp}: hash ids name {TRACE_BLOCK_TOKENS}-token blocks")
    return TraceRow(ts, inp, out, ids)


def default_trace() -> Path:
    """The trace every test, benchmark and command uses unless given one: ``$PDSERVE_TRACE`` when set, else the
    Mooncake conversation trace shipped in the package (:data:`PACKAGED_TRACE`)."""
    env = os.environ.get(TRACE_ENV)
    return Path(env).expanduser() if env else PACKAGED_TRACE


def open_trace(path: str | Path | None = None) -> TextIO:
    """Open a trace for reading text: plain JSONL or gzipped (``.gz``, or gzip's magic bytes); None: the default."""
    p = default_trace() if path is None else Path(path)
    if not p.is_file():
        raise TraceError(f"trace {p} not found: pass a Mooncake-format JSONL file (.jsonl or .jsonl.gz), or unset "
                         f"${TRACE_ENV} to use the packaged conversation trace")
    with p.open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    if gzipped:
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8")
    return p.open(encoding="utf-8")


def trace_lines(path: str | Path | None = None) -> Iterator[tuple[int, str]]:
    """(line number, stripped text) of every non-blank line of a trace file (plain or gzipped)."""
    with open_trace(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if line:
                yield lineno, line


def load_trace(path: str | Path | None = None, start: int = 0, limit: int | None = None) -> list[TraceRow]:
    """Rows ``start .. start+limit`` of a Mooncake-format JSONL trace, plain or gzipped (blank lines skipped);
    ``path`` None: :func:`default_trace`."""
    p = default_trace() if path is None else Path(path)
    rows: list[TraceRow] = []
    for n, (lineno, line) in enumerate(trace_lines(p)):
        if n < start:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{p}:{lineno}: not JSON ({exc})") from None
        rows.append(parse_row(obj, f"{p}:{lineno}: "))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise TraceError(f"{p}: no rows from index {start}")
    return rows


def _shared_blocks(rows: Sequence[TraceRow]) -> tuple[int, int]:
    """(leading blocks each row shares with an earlier one, all blocks), summed over ``rows`` in order."""
    seen: set[tuple[int, ...]] = set()
    shared = total = 0
    for r in rows:
        h = r.hash_ids
        k = 0
        while k < len(h) and h[:k + 1] in seen:
            k += 1
        shared, total = shared + k, total + len(h)
        seen.update(h[:i + 1] for i in range(len(h)))
    return shared, total


def conversation_rows(rows: Sequence[TraceRow], n: int, target: float) -> list[TraceRow]:
    """``n`` of ``rows``, in trace order, whose prefix reuse (leading blocks shared with an earlier chosen row, over
    all blocks) is near ``target``: later turns of conversations together with the earlier turn they extend, and
    rows that extend nothing mixed in whenever the running ratio is above the target. Consecutive rows reuse
    little beyond a one-block system prompt (a conversation's next turn is 100-300 rows later in the conversation
    trace), so a slice of consecutive rows cannot show a pool's value; these rows can."""
    first_with: dict[tuple[int, ...], int] = {}
    parent: dict[int, int] = {}
    for i, r in enumerate(rows):
        h = r.hash_ids
        k = 0
        while k < len(h) and h[:k + 1] in first_with:
            k += 1
        if k > 1:  # more than the shared system-prompt block
            parent[i] = first_with[h[:k]]
        for j in range(len(h)):
            first_with.setdefault(h[:j + 1], i)
    parents = set(parent.values())
    singles = [i for i in range(len(rows)) if i not in parent and i not in parents]
    chosen: set[int] = set()
    children = sorted(parent)
    while len(chosen) < n and (children or singles):
        shared, total = _shared_blocks([rows[i] for i in sorted(chosen)]) if chosen else (0, 0)
        if singles and (not children or (total and shared / total > target)):
            chosen.add(singles.pop(0))
        else:
            child = children.pop(0)
            chosen.update((parent[child], child) if len(chosen) + 2 <= n else (child,))
    return [rows[i] for i in sorted(chosen)]


def scale_rows(rows: Sequence[TraceRow], scale: TraceScale) -> list[ScaledRequest]:
    """Apply ``scale`` to rows (in file order; arrivals start at 0)."""
    if not rows:
        return []
    stamps = spread_timestamps([r.timestamp_ms for r in rows]) if scale.spread else [r.timestamp_ms for r in rows]
    t0 = stamps[0]
    span_s = (stamps[-1] - t0) / 1000.0
    time_factor = scale.time_scale
    if scale.rate is not None:
        if span_s <= 0:
            # every row at the same instant: spread them evenly at the asked rate instead
            time_factor = 0.0
        else:
            # n requests over the span; the rate over arrivals is (n - 1) / span
            time_factor = (len(rows) - 1) / scale.rate / span_s
    out: list[ScaledRequest] = []
    for i, r in enumerate(rows):
        arrival = (stamps[i] - t0) / 1000.0 * time_factor
        if scale.rate is not None and span_s <= 0:
            arrival = i / scale.rate
        output = max(scale.min_output, round(r.output_length * scale.output_scale))
        if scale.max_output is not None:
            output = min(output, scale.max_output)
        inp = max(1, round(r.input_length * scale.input_scale))
        if scale.max_input is not None:
            inp = min(inp, scale.max_input)
        if scale.max_model_len is not None:
            if output >= scale.max_model_len:
                output = scale.max_model_len - 1
            inp = min(inp, scale.max_model_len - output)
        out.append(ScaledRequest(i, arrival, inp, output, r.hash_ids))
    return out


def spread_timestamps(stamps: Sequence[float]) -> list[float]:
    """Rows that share a timestamp, spread evenly until the next distinct one.

    Mooncake's published traces are quantized (the conversation trace to 3 s: ~10 rows per stamp); replayed
    as is, every stamp is a burst. With ``spread`` each group of k rows at t (next stamp t2) arrives at
    t + i * (t2 - t) / k; the last group uses the median gap between stamps. Order and span are kept."""
    if not stamps:
        return []
    distinct = sorted(set(stamps))
    gaps = [b - a for a, b in zip(distinct, distinct[1:])]
    last_gap = float(np.median(gaps)) if gaps else 0.0
    nxt = {a: b for a, b in zip(distinct, distinct[1:])}
    counts: dict[float, int] = {}
    for t in stamps:
        counts[t] = counts.get(t, 0) + 1
    seen: dict[float, int] = {}
    out = []
    for t in stamps:
        k = seen.get(t, 0)
        seen[t] = k + 1
        width = nxt.get(t, t + last_gap) - t
        out.append(t + k * width / counts[t])
    return out


def block_tokens(hash_id: int, n: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """The ``n`` token ids of hash block ``hash_id``: the same for the same (seed, id, n) everywhere."""
    if vocab_size <= TOKEN_LOW:
        raise TraceError(f"vocab_size={vocab_size}: token ids are drawn from [{TOKEN_LOW}, vocab_size); "
                         "give the tokenizer's vocabulary size")
    rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, hash_id & 0xFFFFFFFFFFFFFFFF]))
    return rng.integers(TOKEN_LOW, vocab_size, size=n, dtype=np.int64)


def prompt_ids(req: ScaledRequest, block: int, vocab_size: int, seed: int = 0) -> list[int]:
    """Token ids for a scaled request: hash blocks of ``block`` tokens cut at ``input_length``.

    Past the named blocks (a row without hash ids, or a length the ids do not cover) the tokens are unique to
    the row, seeded by its index under a separate stream so they never collide with a hash block.
    """
    need = req.input_length
    parts: list[np.ndarray] = []
    have = 0
    for h in req.hash_ids:
        if have >= need:
            break
        take = min(block, need - have)
        parts.append(block_tokens(h, block, vocab_size, seed)[:take])
        have += take
    if have < need:
        rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, 1 << 40, req.index]))
        parts.append(rng.integers(TOKEN_LOW, vocab_size, size=need - have, dtype=np.int64))
    return [int(t) for t in np.concatenate(parts)] if parts else []


def shared_prefix_len(a: Iterable[int], b: Iterable[int]) -> int:
    """Length of the common prefix of two token lists (used by tests and the trace summary)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def trace_summary(reqs: Sequence[ScaledRequest]) -> dict[str, float]:
    """Mean/median lengths and the mean arrival rate of scaled requests."""
    if not reqs:
        return {"requests": 0}
    inp = [r.input_length for r in reqs]
    out = [r.output_length for r in reqs]
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    return {"requests": len(reqs), "input_mean": float(np.mean(inp)), "input_p50": float(np.median(inp)),
            "output_mean": float(np.mean(out)), "output_p50": float(np.median(out)),
            "span_s": span, "rate": (len(reqs) - 1) / span if span > 0 else math.inf}


def export_mooncake(reqs: Sequence[ScaledRequest], block: int, path: str | Path) -> Path:
    """Write scaled requests back as a Mooncake-format trace (timestamps in ms, hash ids trimmed to the blocks
    the scaled prompt covers), for other replay tools: AIPerf's ``mooncake_trace`` with
    ``--isl-block-size <block>`` then sees the same lengths, timing and sharing as ``pdserve bench``."""
    p = Path(path)
    with p.open("w") as f:
        for r in reqs:
            ids = list(r.hash_ids[:math.ceil(r.input_length / block)])
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000.0), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": ids}) + "\n")
    return p
