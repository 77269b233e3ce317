"""decode_spread (pdserve.bench.matrix): where a run's requests decoded and which prompts were split."""

from pdserve.bench.matrix import decode_spread
from pdserve.bench.metrics import RequestRecord


def rec(prompt: int, decode: str | None, prefill: str | None = None, ok: bool = True) -> RequestRecord:
    t = {"decode_worker": decode, "prefill_worker": prefill} if decode else None
    return RequestRecord(ok, 0.0, prompt_tokens=prompt, timings=t)


def test_counts_decodes_per_worker_and_short_and_long_splits():
    recs = [rec(100, "http://a"), rec(100, "http://b", "http://a"), rec(1500, "http://b", "http://a"),
            rec(499, "http://b", "http://a"), rec(500, "http://a"), rec(90, "http://b", ok=False), rec(90, None)]
    assert decode_spread(recs) == {"decodes_per_worker": [3, 2], "short_split": 2, "long_split": 1}


def test_nothing_timed():
    assert decode_spread([rec(10, None)]) == {"decodes_per_worker": [], "short_split": 0, "long_split": 0}
