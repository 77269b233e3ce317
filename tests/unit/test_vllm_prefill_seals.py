"""pdserve.vllm.prefill_seals.PrefillSeals and the scheduler half around it: a leased prompt's blocks are named for
sealing in the step whose forward completes the prompt (across prefill chunks, new blocks appended, a resumed
request's replaced), and settled at request_finished (kept for the same blocks, forgotten otherwise).

No vLLM: the scheduler output is a small fake with the attributes vLLM's SchedulerOutput has."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pdserve.vllm.params import ConnectorConfig
from pdserve.vllm.prefill_seals import PrefillSeals
from pdserve.vllm.scheduler import SchedulerSide
from tests.unit.test_vllm_scheduler import HS, SECRET, Blocks, Req, Status, prompt

BS = 4


def output(scheduled: dict[str, int], new: list[tuple[str, list[int], int]] = (),
           cached: list[tuple[str, list[int] | None, int]] = (), resumed: set[str] = frozenset()) -> SimpleNamespace:
    """vLLM's SchedulerOutput: new requests (id, all block ids, computed), running ones (id, new block ids or
    None, computed), tokens scheduled per request."""
    return SimpleNamespace(
        total_num_scheduled_tokens=sum(scheduled.values()), num_scheduled_tokens=scheduled,
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached], resumed_req_ids=set(resumed),
                                              new_block_ids=[(b,) if b is not None else None for _, b, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached]))


def test_a_one_step_prefill_is_sealed_in_that_step():
    seals, faults = PrefillSeals(BS), {}
    seals.watch("p", 10, fault="late")
    assert seals.step(output({"p": 10}, new=[("p", [7, 8, 9], 0)]), faults) == {"p": (7, 8, 9)}
    assert faults == {"p": "late"}
    assert seals.step(output({"p": 1}, cached=[("p", None, 10)]), {}) == {}  # once
    assert seals.finished("p", (7, 8, 9)) == (True, False) and len(seals) == 0


def test_a_chunked_prefill_is_sealed_at_its_last_chunk_with_every_chunk_s_blocks():
    seals = PrefillSeals(BS)
    seals.watch("p", 14)
    assert seals.step(output({"p": 8}, new=[("p", [1, 2], 0)]), {}) == {}
    assert seals.step(output({"p": 4}, cached=[("p", [3], 8)]), {}) == {}
    assert seals.step(output({"x": 4}), {}) == {}  # not scheduled this step
    assert seals.step(output({"p": 2}, cached=[("p", [4, 5], 12)]), {}) == {"p": (1, 2, 3, 4)}


def test_a_prefix_hit_counts_as_computed_and_a_resumed_request_s_blocks_replace_its_old_ones():
    seals = PrefillSeals(BS)
    seals.watch("p", 9)
    assert seals.step(output({"p": 1}, new=[("p", [5, 6, 7], 8)]), {}) == {"p": (5, 6, 7)}
    seals.watch("q", 9)
    assert seals.step(output({"q": 4}, new=[("q", [1, 2, 3], 0)]), {}) == {}
    assert seals.step(output({"q": 5}, cached=[("q", [9, 8, 7], 4)], resumed={"q"}), {}) == {"q": (9, 8, 7)}


def test_finished_keeps_a_seal_only_for_the_same_leased_blocks():
    seals = PrefillSeals(BS)
    for r in ("same", "other", "unleased"):
        seals.watch(r, 4)
        seals.step(output({r: 4}, new=[(r, [1], 0)]), {})
    assert seals.finished("same", (1,)) == (True, False)
    assert seals.finished("other", (2,)) == (False, True)
    assert seals.finished("unleased", None) == (False, True)
    seals.watch("never-done", 4)  # aborted mid-prefill: nothing sealed, nothing to forget
    assert seals.finished("never-done", None) == (False, False) and len(seals) == 0


def _side(**extra: Any) -> SchedulerSide:
    s = SchedulerSide(ConnectorConfig.from_extra({"secret": SECRET, **extra}), BS)
    s.set_handshake({0: HS})
    return s


def _prefill(s: SchedulerSide, req: Req, blocks: list[int]) -> Any:
    s.update_state_after_alloc(req, Blocks(blocks), 0)
    return s.build_connector_meta(output({req.request_id: req.num_prompt_tokens},
                                         new=[(req.request_id, blocks, 0)]))


def test_the_scheduler_seals_at_the_prefill_s_forward_and_not_again_at_the_lease():
    s = _side(allow_test_faults=True)
    req = Req("p1", prompt(10), {"do_remote_decode": True, "pdserve_test_fault": "late"})
    meta = _prefill(s, req, [7, 8, 9])
    assert meta.seal_now == {"p1": (7, 8, 9)} and meta.faults == {"p1": "late"}
    req.status, req.num_computed_tokens = Status.FINISHED_LENGTH_CAPPED, 10
    delay, params = s.request_finished(req, [7, 8, 9])
    assert delay and params["remote_block_ids"] == [7, 8, 9]
    meta = s.build_connector_meta(None)
    assert "p1" in meta.send and meta.seal == {} and meta.unseal == [] and meta.faults == {}


def test_an_aborted_prefill_s_early_seal_is_forgotten_by_the_worker():
    s = _side()
    req = Req("p1", prompt(10), {"do_remote_decode": True})
    assert _prefill(s, req, [7, 8, 9]).seal_now == {"p1": (7, 8, 9)}
    req.status = Status.FINISHED_ABORTED
    assert s.request_finished(req, [7, 8, 9]) == (False, None)
    meta = s.build_connector_meta(None)
    assert meta.unseal == ["p1"] and meta.seal == {} and meta.send == {}


def test_a_request_preempted_after_its_seal_has_the_old_seal_forgotten_before_the_new_one():
    """Preempted after the forward that sealed it, then scheduled again: the worker forgets the old seal (whose
    blocks may not be the lease's) before the new one is made, so the lease is never answered with stale sums."""
    s = _side()
    req = Req("p1", prompt(10), {"do_remote_decode": True})
    assert _prefill(s, req, [7, 8, 9]).seal_now == {"p1": (7, 8, 9)}
    meta = _prefill(s, req, [3, 4, 5])  # rescheduled after a preemption, on other blocks
    assert meta.unseal == ["p1"] and meta.seal_now == {"p1": (3, 4, 5)}
    req.status, req.num_computed_tokens = Status.FINISHED_LENGTH_CAPPED, 10
    assert s.request_finished(req, [3, 4, 5])[0]
    meta = s.build_connector_meta(None)
    assert meta.seal == {} and meta.unseal == []  # the new seal stands for the lease


def test_checksums_off_watch_nothing():
    s = _side(kv_checksum=False)
    assert _prefill(s, Req("p1", prompt(10), {"do_remote_decode": True}), [7, 8, 9]).seal_now == {}
    assert len(s.prefill_seals) == 0
