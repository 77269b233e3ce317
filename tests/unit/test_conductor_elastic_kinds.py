"""The three elastic placement kinds (pdserve.conductor.elastic) with the workers' step budget known
(``chunk_tokens`` = vLLM --max-num-batched-tokens = 32 here). Cost model as in test_conductor_elastic: 1 ms per new
prompt token, decode step 10 ms + 1 ms per sequence, 50 ms hand-off, ``local_stall_s`` 50 ms."""

import pytest

from pdserve.conductor import ConductorConfig, ConductorConfigError
from pdserve.conductor.elastic import prefill_on, prefilling_long, step_budget
from pdserve.router.fleet.placement import too_busy
from tests.unit.test_conductor_elastic import LONG, SHORT, decoding, make, req

CHUNK = 32
MEDIUM = list(range(2000, 2096))  # 96 tokens: 96 ms in one step, long; chunked, 30 ms per step of 30 tokens


def test_short_prompt_on_idle_pool_is_colocated():
    c = make(chunk_tokens=CHUNK)
    d = c.place(req("r", SHORT))
    assert (d.kind, d.placement, d.prefill, d.decode) == ("local", "colocated", None, "e0")
    assert d.ttft_s == pytest.approx(0.016)
    assert d.reason == "elastic colocated on e0: 16 uncached prompt tokens (short), stalls 0 running decode(s) by 0 ms"
    assert c.placements == {"colocated": 1, "chunked": 0, "split": 0}


def test_long_prompt_while_another_worker_is_idle_runs_colocated_on_the_idle_one():
    c = make(chunk_tokens=CHUNK)
    decoding(c, "e0", 2)
    d = c.place(req("long", LONG))
    # chunked into e0 would cost 160 ms + 6 shared steps of 12 ms, plus 2 x 160 ms of harm; e1 runs no decode.
    # Next to one decode on e1 the prompt would be chunked 31 tokens a step (31 ms < the 50 ms stall limit):
    # short, so its decode stays on e1 (no hand-off)
    assert (d.kind, d.placement, d.prefill, d.decode) == ("local", "colocated", None, "e1")
    assert d.ttft_s == pytest.approx(0.160)
    assert d.tpot_s == pytest.approx(0.011)  # alone on e1
    assert c.placements == {"colocated": 1, "chunked": 0, "split": 0}


def test_medium_prompt_when_every_worker_decodes_is_chunked_within_the_tpot_target():
    c = make(chunk_tokens=CHUNK, tpot_slo_s=0.05)
    decoding(c, "e0", 2)
    decoding(c, "e1", 2)
    d = c.place(req("m", MEDIUM))
    # step budget 32 - 2 decodes = 30 tokens: 4 steps; each adds one 30-token chunk (30 ms) to e0's 12 ms step
    assert (d.kind, d.placement, d.prefill, d.decode) == ("local", "chunked", None, "e0")
    assert d.ttft_s == pytest.approx(0.096 + 4 * 0.012)
    assert d.tpot_s == pytest.approx(0.013)
    assert d.reason == ("elastic chunked on e0: 96 uncached prompt tokens (short), in 4 steps of <= 30 tokens, "
                        "slows 2 running decode(s) by 30 ms per step (42 ms per token)")
    assert c.placements == {"colocated": 0, "chunked": 1, "split": 0}
    s = prefill_on(c, c.prefill_options(req("m2", MEDIUM), [c.workers["e1"]], {}, c.clock())[0])
    assert (s.steps, s.stall_s, s.step_s, s.harm_s) == (4, pytest.approx(0.030), pytest.approx(0.042),
                                                         pytest.approx(2 * 0.096))


def test_without_the_step_budget_the_same_prompt_is_one_stall_and_misses_the_target():
    """chunk_tokens unknown: the 96 ms prefill stalls the decodes in one 108 ms step, over the 50 ms target."""
    c = make(tpot_slo_s=0.05)
    decoding(c, "e0", 2)
    decoding(c, "e1", 2)
    d = c.place(req("m", MEDIUM))
    assert (d.kind, d.code) == ("reject", "slo")
    assert d.reason == ("prefilling on e0 would slow its 2 running decode(s) to 108.0 ms per token > TPOT target "
                        "50.0 ms")


def test_chunked_step_over_the_tpot_target_is_rejected_with_429():
    c = make(chunk_tokens=CHUNK, tpot_slo_s=0.04)
    decoding(c, "e0", 2)
    decoding(c, "e1", 2)
    d = c.place(req("m", MEDIUM))
    assert (d.kind, d.code, d.retry_after_s) == ("reject", "slo", 2.0)  # 100 tokens left x 12 ms: 1.2 s -> 2 s
    assert d.reason == ("prefilling on e0 would slow its 2 running decode(s) to 42.0 ms per token > TPOT target "
                        "40.0 ms")
    assert c.in_flight() == 0 and c.placements == {"colocated": 0, "chunked": 0, "split": 0}
    e = too_busy(d)
    assert (e.status, e.code, e.headers) == (429, "slo_unattainable", {"Retry-After": "2"})


def test_big_chunks_make_the_medium_prompt_long_so_it_is_split():
    """With 64-token steps one chunk is 62 ms, over the 50 ms stall limit: the prefill is long on e0 and the
    decode leaves it (split, same cost as chunked on e0, preferred for a long prefill)."""
    c = make(chunk_tokens=64)
    decoding(c, "e0", 2)
    decoding(c, "e1", 2)
    d = c.place(req("m", MEDIUM))
    assert (d.kind, d.placement, d.prefill, d.decode) == ("disaggregated", "split", "e0", "e1")
    assert d.ttft_s == pytest.approx(0.096 + 2 * 0.012)  # two chunked steps on e0
    assert "in 2 chunked steps" in d.reason
    assert prefilling_long(c, c.workers["e0"])


def test_prompt_within_one_step_on_a_decoding_worker_is_colocated():
    c = make(chunk_tokens=CHUNK)
    decoding(c, "e0", 2)
    decoding(c, "e1", 3)
    d = c.place(req("s", SHORT))
    assert (d.kind, d.placement, d.decode) == ("local", "colocated", "e0")
    assert d.ttft_s == pytest.approx(0.016 + 0.012)


def test_step_budget_and_chunk_tokens_validation():
    c = make(chunk_tokens=CHUNK)
    assert (step_budget(c, 0), step_budget(c, 2), step_budget(c, 40)) == (32, 30, 1)
    assert step_budget(make(), 2) is None
    for bad in (0, -1, 1.5, True, "512"):
        with pytest.raises(ConductorConfigError, match="--max-num-batched-tokens"):
            ConductorConfig(chunk_tokens=bad)
