"""Requests to simulate: a Mooncake-format trace (scaled) or synthetic Poisson arrivals with length mixes."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # Mooncake traces hash prompts in 512-token blocks


@dataclass(frozen=True)
class Request:
    """One request: arrival (s), prompt and output lengths, and block keys of its full prompt blocks."""

    rid: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_keys: tuple[int, ...] = ()


def block_keys_from_hash_ids(hash_ids: Sequence[int], prompt_tokens: int, block_size: int) -> tuple[int, ...]:
    """Keys of the full ``block_size`` blocks of a prompt described by 512-token chained hash ids.

    Equal hash ids mean equal prefixes, so sub-block j of hash id h gets key (h, j) packed in one int."""
    per = max(1, TRACE_BLOCK_TOKENS // block_size)
    n_full = prompt_tokens // block_size
    keys = [int(h) * per + j + 1 for h in hash_ids for j in range(per)]
    return tuple(keys[:n_full])


def load_trace(path: str | Path | None, block_size: int = 128, time_scale: float = 1.0, length_scale: float = 1.0,
               rate: float | None = None, limit: int | None = None, output_scale: float | None = None
               ) -> list[Request]:
    """Mooncake trace (one JSON object per line: timestamp ms, input_length, output_length, hash_ids).

    ``time_scale`` stretches inter-arrival times (2 = half the rate) unless ``rate`` (req/s) is given, which
    rescales them to that mean rate. ``length_scale`` scales prompt lengths (and block keys with them);
    ``output_scale`` output lengths (default: ``length_scale``). ``path``: plain or gzipped JSONL; None: the
    default trace (:func:`pdserve.bench.traces.default_trace`)."""
    from ..bench.traces import trace_lines

    rows = []
    for _, line in trace_lines(path):
        rows.append(json.loads(line))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"{path}: no requests")
    t0 = rows[0]["timestamp"] / 1e3
    span = rows[-1]["timestamp"] / 1e3 - t0
    if rate is not None:
        time_scale = (len(rows) - 1) / rate / span if span > 0 else 1.0
    out_scale = length_scale if output_scale is None else output_scale
    reqs = []
    for i, r in enumerate(rows):
        prompt = max(1, int(round(r["input_length"] * length_scale)))
        output = max(1, int(round(r["output_length"] * out_scale)))
        keys = block_keys_from_hash_ids(r.get("hash_ids", []), r["input_length"], block_size)
        keys = keys[:prompt // block_size]  # a scaled prompt keeps the leading (shared) blocks
        reqs.append(Request(f"r{i}", (r["timestamp"] / 1e3 - t0) * time_scale, prompt, output, keys))
    return reqs


@dataclass(frozen=True)
class LengthMix:
    """Prompt/output lengths: weighted (weight, prompt tokens, output tokens) entries, jittered +-jitter."""

    entries: tuple[tuple[float, int, int], ...]
    jitter: float = 0.0

    @classmethod
    def parse(cls, text: str, jitter: float = 0.0) -> LengthMix:
        """``"0.25:1536:64,0.75:100:64"`` (weight:prompt:output) or ``"2048:64"`` (one shape)."""
        entries = []
        for part in text.split(","):
            bits = [b for b in part.strip().split(":") if b]
            if len(bits) == 2:
                bits = ["1", *bits]
            if len(bits) != 3:
                raise ValueError(f"length mix entry {part!r}: use weight:prompt:output or prompt:output")
            w, p, o = float(bits[0]), int(bits[1]), int(bits[2])
            if w <= 0 or p < 1 or o < 1:
                raise ValueError(f"length mix entry {part!r}: weight > 0, prompt >= 1, output >= 1")
            entries.append((w, p, o))
        return cls(tuple(entries), jitter)

    def sample(self, rng: random.Random) -> tuple[int, int]:
        w, p, o = rng.choices(self.entries, weights=[e[0] for e in self.entries])[0]
        j = lambda n: max(1, int(round(n * (1 + rng.uniform(-self.jitter, self.jitter)))))  # noqa: E731
        return j(p), j(o)

    def mean_prompt(self) -> float:
        tot = sum(e[0] for e in self.entries)
        return sum(e[0] * e[1] for e in self.entries) / tot


def poisson(rate: float, count: int, mix: LengthMix, seed: int = 0, block_size: int = 128,
            shared_prefix_tokens: int = 0) -> list[Request]:
    """``count`` Poisson arrivals at ``rate`` req/s. Prompts share their first ``shared_prefix_tokens``
    (a system prompt); the rest of every prompt is unique."""
    if rate <= 0 or count <= 0:
        raise ValueError("rate and count must be > 0")
    rng = random.Random(seed)
    t = 0.0
    reqs = []
    shared_blocks = shared_prefix_tokens // block_size
    for i in range(count):
        t += rng.expovariate(rate)
        p, o = mix.sample(rng)
        n_full = p // block_size
        keys = tuple(range(1, min(shared_blocks, n_full) + 1)) + tuple(
            (seed + 1) * 10 ** 12 + i * 10 ** 5 + j for j in range(max(0, n_full - shared_blocks)))
        reqs.append(Request(f"r{i}", t, p, o, keys))
    return reqs
