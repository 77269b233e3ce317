"""pdserve.vllm.scheduler.SchedulerSide with small fake vLLM requests and blocks: P's lease, D's read plan,
the per-step metadata, the worker's reports, and the KV pool match/plan.

No vLLM, no torch: the scheduler half duck-types vLLM's objects.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.hashing import block_hashes
from pdserve.store import StoreError
from pdserve.vllm import scheduler as sched_mod
from pdserve.vllm.messages import PdserveHandshake, PdserveMeta, PdserveWorkerMeta, PoolJob, RecvJob
from pdserve.vllm.params import BlockPlan, ConnectorConfig, RemoteParams, prompt_hash
from pdserve.vllm.scheduler import SchedulerSide

SECRET = "0123456789abcdef-secret"
BS = 4  # tokens per block
NOW = 1000.0
HS = PdserveHandshake("engine-p", "10.0.0.1", 7000, "float32/bs4/L2/abc")


class Status(enum.Enum):  # the names the scheduler reads from vLLM's RequestStatus
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH_CAPPED = 3
    FINISHED_ABORTED = 4


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    status: Status = Status.RUNNING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class Blocks:
    """vLLM's KVCacheBlocks: one group; the first ``hashed`` blocks are prefix-cache hits."""

    def __init__(self, ids: list[int], hashed: int = 0) -> None:
        self.ids = ids
        self.blocks = ([SimpleNamespace(block_hash=(i if n < hashed else None)) for n, i in enumerate(ids)],)

    def get_block_ids(self) -> list[list[int]]:
        return [list(self.ids)]


class Pool:
    """The pool master's prefix lookup: ``pooled`` leading keys of any asked chain are held."""

    def __init__(self, pooled: int = 0, fail: bool = False) -> None:
        self.pooled, self.fail, self.asked = pooled, fail, []

    def prefix(self, keys: list[int]) -> int:
        self.asked.append(list(keys))
        if self.fail:
            raise StoreError("unavailable", "master down")
        return min(self.pooled, len(keys))


@pytest.fixture
def clock(monkeypatch):
    """Freeze the scheduler's clocks; record its idle sleeps."""
    fake = SimpleNamespace(now=NOW, mono=50.0, sleeps=[])
    fake.time = lambda: fake.now
    fake.monotonic = lambda: fake.mono
    fake.sleep = fake.sleeps.append
    monkeypatch.setattr(sched_mod, "time", fake)
    return fake


def side(pool: Pool | None = None, prefix_caching: bool = True, **extra: Any) -> SchedulerSide:
    if pool is not None:
        extra.setdefault("pool_master", "127.0.0.1:7600")
    s = SchedulerSide(ConnectorConfig.from_extra({"secret": SECRET, **extra}), BS, pool, prefix_caching=prefix_caching)
    s.set_handshake({0: HS})
    return s


def prompt(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def p_finished(s: SchedulerSide, req_id: str = "p1", n: int = 10, **params: Any):
    req = Req(req_id, prompt(n), {"do_remote_decode": True, **params}, Status.FINISHED_LENGTH_CAPPED, n)
    return s.request_finished(req, [7, 8, 9, 10])


def remote_params(n: int = 10, deadline: float = NOW + 30, **over: Any) -> dict[str, Any]:
    r = RemoteParams(HS.engine_id, HS.host, HS.port, (7, 8, 9), n, "p1", HS.layout, prompt_hash(prompt(n), n),
                     deadline)
    return {**r.to_params(), **over}


def worker_meta(**kw: Any) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_worker_meta=PdserveWorkerMeta(**kw))


# ------------------------------------------------------------------------------------------ P
def test_scheduler_half_imports_no_vllm():
    import subprocess

    code = ("import sys, pdserve.vllm.scheduler, pdserve.vllm.release; "
            "sys.exit(any(m == 'vllm' or m.startswith('vllm.') or m == 'torch' for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("status, params, leased", [
    (Status.FINISHED_LENGTH_CAPPED, {"lease_on_stop": False}, True),  # the one-token prefill a D continues
    (Status.FINISHED_STOPPED, {"lease_on_stop": False}, False),  # its first token ended it: no D will come
    (Status.FINISHED_STOPPED, {}, True),  # a D that regenerates the first token still reads it (default)
    (Status.FINISHED_ABORTED, {}, False),
])
def test_p_leases_a_stopped_prefill_only_when_its_caller_may_still_decode_it(clock, status, params, leased):
    s = side()
    req = Req("p1", prompt(10), {"do_remote_decode": True, **params}, status, 10)
    delay, out = s.request_finished(req, [7, 8, 9, 10])
    assert delay is leased and (out is not None) is leased and s.held == int(leased)
    assert s.build_connector_meta(None).send == ({"p1": NOW + 30.0} if leased else {})


def test_p_request_finished_leases_the_prompt_blocks(clock):
    s = side()
    delay, params = p_finished(s)
    assert delay is True
    assert params == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p",
        "remote_host": "10.0.0.1", "remote_port": 7000, "remote_block_ids": [7, 8, 9], "remote_num_tokens": 10,
        "remote_request_id": "p1", "remote_kv_layout": HS.layout, "remote_prompt_hash": prompt_hash(prompt(10), 10),
        "remote_lease_deadline": NOW + 30.0}
    assert s.held == 1
    meta = s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=5))
    assert isinstance(meta, PdserveMeta)
    assert meta.send == {"p1": NOW + 30.0} and meta.recv == [] and meta.pool == []
    assert s.build_connector_meta(None).send == {}  # handed over once
    s.update_connector_output(worker_meta(released={"p1": "notified"}))
    assert s.held == 0


@pytest.mark.parametrize("lease, deadline", [(2, NOW + 2.0), ("3.5", NOW + 3.5), (0, NOW + 0.1),
                                             (1e9, NOW + 3600.0), ("soon", NOW + 30.0)])
def test_p_per_request_lease_override_is_bounded(clock, lease, deadline):
    _, params = p_finished(side(), lease_s=lease)
    assert params["remote_lease_deadline"] == deadline


def test_p_computed_tokens_cap_the_hand_off(clock):
    s = side()
    req = Req("p2", prompt(10), {"do_remote_decode": True}, Status.FINISHED_STOPPED, num_computed_tokens=8)
    delay, params = s.request_finished(req, [7, 8, 9])
    assert delay and params["remote_num_tokens"] == 8 and params["remote_block_ids"] == [7, 8]
    assert params["remote_prompt_hash"] == prompt_hash(prompt(10), 8)


@pytest.mark.parametrize("case", ["aborted", "no_handshake", "no_params", "nothing_computed", "too_few_blocks",
                                  "plain"])
def test_p_frees_at_once_when_there_is_nothing_to_hand_off(clock, case):
    s = side()
    params: dict[str, Any] | None = {"do_remote_decode": True}
    status, computed, blocks = Status.FINISHED_LENGTH_CAPPED, 10, [7, 8, 9]
    if case == "aborted":
        status = Status.FINISHED_ABORTED
    elif case == "no_handshake":
        s.handshake = None
    elif case == "no_params":
        params = None
    elif case == "nothing_computed":
        computed = 0
    elif case == "too_few_blocks":
        blocks = [7, 8]
    elif case == "plain":
        params = {"something": 1}
    assert s.request_finished(Req("p", prompt(10), params, status, computed), blocks) == (False, None)
    assert s.held == 0 and s.build_connector_meta(None) == PdserveMeta()


def test_handshake_must_be_pdserve_s():
    s = SchedulerSide(ConnectorConfig.from_extra({"secret": SECRET}), BS)
    with pytest.raises(ValueError, match="expected PdserveHandshake"):
        s.set_handshake({0: object()})
    s.set_handshake({1: HS})  # any rank when rank 0 is missing
    assert s.handshake is HS


# ------------------------------------------------------------------------------------------ D
def test_d_matches_the_tokens_its_prefix_cache_lacks(clock):
    s = side()
    req = Req("d1", prompt(11), remote_params())  # the prompt plus P's first token
    assert s.get_num_new_matched_tokens(req, 4) == (6, True)
    assert s.get_num_new_matched_tokens(Req("d2", prompt(11), remote_params()), 0) == (10, True)
    assert s.get_num_new_matched_tokens(Req("d3", prompt(11), remote_params()), 12) == (0, False)


@pytest.mark.parametrize("d_prompt, p_tokens, matched", [(11, 10, 10), (10, 10, 0), (12, 10, 0), (13, 10, 0)])
def test_d_without_prefix_caching_takes_p_s_kv_only_for_the_step_after_p_s_prompt(clock, d_prompt, p_tokens, matched):
    """An engine with prefix caching off (vLLM: MLA on CPU) computes a prompt in one pass and each later token in a
    step of its own; P's KV may stand in for P's prompt only when what is left is that next step (D's prompt is P's
    plus P's first token), never a prompt token or a suffix computed on top of loaded KV."""
    s = side(prefix_caching=False)
    params = remote_params(p_tokens, remote_prompt_hash=prompt_hash(prompt(d_prompt), min(p_tokens, d_prompt)))
    assert s.get_num_new_matched_tokens(Req("d1", prompt(d_prompt), params), 0) == (matched, matched > 0)


def test_no_pool_for_an_engine_without_prefix_caching(clock):
    pool = Pool(pooled=3)
    s = side(pool, prefix_caching=False)
    assert s.get_num_new_matched_tokens(Req("n1", prompt(13)), 0) == (0, False) and pool.asked == []
    req = Req("f1", prompt(9), None, Status.FINISHED_STOPPED, num_computed_tokens=10, output_token_ids=[1, 2])
    assert s.request_finished(req, [40, 41, 42]) == (False, None)  # nothing pooled that no such engine may load
    assert s.build_connector_meta(None).pool == []


@pytest.mark.parametrize("over, now", [({"remote_prompt_hash": "other"}, NOW), ({"remote_kv_layout": "bf16/x"}, NOW),
                                       ({}, NOW + 29.6), ({"remote_block_ids": [1]}, NOW),
                                       ({"remote_port": None}, NOW)])
def test_d_computes_locally_when_p_s_blocks_are_unusable(clock, over, now):
    clock.now = now  # past deadline - clock_margin_s (0.5 s) for the third case
    s = side()
    req = Req("d1", prompt(11), remote_params(**over))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)


def test_d_invalid_params_are_dropped_and_never_read(clock):
    s = side()
    req = Req("d1", prompt(11), remote_params(remote_block_ids=[1]))  # 1 block cannot hold 10 tokens
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    s.update_state_after_alloc(req, Blocks([20, 21, 22]), 0)
    assert s.build_connector_meta(None).recv == []


def test_d_pairs_its_new_blocks_with_p_s_after_alloc(clock):
    s = side()
    req = Req("d1", prompt(11), remote_params())
    assert s.get_num_new_matched_tokens(req, 4) == (6, True)
    s.update_state_after_alloc(req, Blocks([20, 21, 22, 23], hashed=1), 6)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # one transfer, even if rescheduled
    meta = s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    remote = RemoteParams.parse(remote_params(), BS)
    assert meta.recv == [RecvJob("d1", remote, BlockPlan((21, 22), (8, 9)))]
    assert s.reading == 1
    s.update_state_after_alloc(req, Blocks([20, 21, 22, 23]), 6)  # rescheduled: no second read
    assert s.build_connector_meta(None).recv == []


def test_d_counts_hashed_blocks_when_match_was_not_asked(clock):
    s = side()
    req = Req("d1", prompt(11), remote_params())
    s.update_state_after_alloc(req, Blocks([20, 21, 22], hashed=2), 2)
    assert s.build_connector_meta(None).recv[0].plan == BlockPlan((22,), (9,))


def test_d_unplannable_read_becomes_a_failed_job(clock):
    s = side()
    req = Req("d1", prompt(11), remote_params())
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([20, 21]), 10)  # 2 local blocks for 3 blocks of KV
    (job,) = s.build_connector_meta(None).recv
    assert job.req_id == "d1" and job.load and job.plan == BlockPlan((), ()) and "plan needs blocks" in job.error


def test_d_with_nothing_to_load_only_releases_p(clock):
    s = side()
    req = Req("d1", prompt(11), remote_params())
    s.update_state_after_alloc(req, Blocks([20, 21, 22]), 0)
    (job,) = s.build_connector_meta(None).recv
    assert (job.req_id, job.load, job.plan, job.error) == ("d1", False, BlockPlan((), ()), "")
    assert s.reading == 0  # nothing the scheduler waits for


def test_d_finished_before_scheduled_releases_p(clock):
    s = side()
    req = Req("d1", prompt(11), remote_params(), Status.FINISHED_ABORTED)
    assert s.request_finished(req, []) == (False, None)
    (job,) = s.build_connector_meta(None).recv
    assert job.req_id == "d1" and not job.load and job.remote.request_id == "p1"


def test_d_read_results_reach_the_response_and_unblock_pacing(clock):
    s = side()
    ok = {"bytes": 4096, "ms": 1.5, "blocks": 2, "ok": True}
    bad = {"bytes": 0, "ms": 0.2, "blocks": 1, "ok": False, "error": "TransferError: x"}
    for rid in ("d1", "d2"):
        req = Req(rid, prompt(11), remote_params())
        s.get_num_new_matched_tokens(req, 4)
        s.update_state_after_alloc(req, Blocks([20, 21, 22]), 6)
    assert len(s.build_connector_meta(None).recv) == 2 and s.reading == 2
    s.update_connector_output(worker_meta(reads={"d1": ok}))
    assert s.reading == 1
    s.update_connector_output(worker_meta(reads={"d2": bad}))
    assert s.reading == 0
    s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))  # no report this step
    d1 = Req("d1", prompt(11), {"do_remote_prefill": False}, Status.FINISHED_STOPPED)
    assert s.request_finished(d1, [20, 21, 22]) == (False, {"pdserve": ok})
    d2 = Req("d2", prompt(11), {"do_remote_prefill": False}, Status.FINISHED_STOPPED)
    assert s.request_finished(d2, [20, 21, 22]) == (False, {"pdserve": bad})
    assert s.request_finished(d1, [20]) == (False, None)  # collected once


def test_read_stats_are_bounded(clock):
    s = side()
    s.update_connector_output(worker_meta(reads={f"r{i}": {"ok": True} for i in range(sched_mod.MAX_READ_STATS + 5)}))
    late = Req("r4", prompt(3), {"do_remote_prefill": False})
    assert s.request_finished(late, []) == (False, None)  # the oldest were dropped
    kept = Req("r5", prompt(3), {"do_remote_prefill": False})
    assert s.request_finished(kept, []) == (False, {"pdserve": {"ok": True}})


def test_idle_steps_are_paced_only_while_blocks_are_held(clock):
    s = side(idle_wait_ms=25)
    idle = SimpleNamespace(total_num_scheduled_tokens=0)
    s.build_connector_meta(idle)
    assert clock.sleeps == []  # nothing held
    p_finished(s)
    s.build_connector_meta(idle)  # hands the lease over: not idle
    assert clock.sleeps == []
    s.build_connector_meta(idle)
    s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=3))
    assert clock.sleeps == [0.025]
    s.update_connector_output(worker_meta(released={"p1": "lease"}))
    s.build_connector_meta(idle)
    assert clock.sleeps == [0.025]


def test_worker_meta_aggregates_ranks():
    a = PdserveWorkerMeta({"r": {"bytes": 10, "ms": 2.0, "ok": True}}, {"p": "notified"}, {"x": "saved"})
    b = PdserveWorkerMeta({"r": {"bytes": 5, "ms": 3.0, "ok": False}, "s": {"bytes": 1, "ms": 1.0, "ok": True}},
                          {"q": "lease"}, {"y": "loaded"})
    m = a.aggregate(b)
    assert m.reads == {"r": {"bytes": 15, "ms": 3.0, "ok": False}, "s": {"bytes": 1, "ms": 1.0, "ok": True}}
    assert m.released == {"p": "notified", "q": "lease"} and m.pool == {"x": "saved", "y": "loaded"}
    assert a.reads["r"]["bytes"] == 10 and PdserveWorkerMeta().is_empty() and not m.is_empty()


# --------------------------------------------------------------------------------------- pool
def test_pool_match_counts_pooled_blocks_after_the_local_hit(clock):
    pool = Pool(pooled=2)
    s = side(pool)
    req = Req("n1", prompt(13))
    keys = block_hashes(prompt(13), BS)
    assert s.get_num_new_matched_tokens(req, 4) == (8, True)
    assert pool.asked == [keys[1:]]
    s.update_state_after_alloc(req, Blocks([30, 31, 32, 33]), 8)
    meta = s.build_connector_meta(None)
    assert meta.pool == [PoolJob("n1", tuple(keys[1:3]), (31, 32), False)] and meta.recv == []
    assert s.reading == 1
    s.update_connector_output(worker_meta(pool={"n1": "loaded"}))
    assert s.reading == 0 and s.pool_outcomes == {"loaded": 1}


@pytest.mark.parametrize("pooled, computed, extra", [(0, 0, {}), (2, 3, {}), (5, 12, {}), (1, 0, {"pool_min_blocks": 2}),
                                                     (3, 0, {"pool_load": False})])
def test_pool_match_declines(clock, pooled, computed, extra):
    s = side(Pool(pooled=pooled), **extra)
    assert s.get_num_new_matched_tokens(Req("n1", prompt(13)), computed) == (0, False)
    s.update_state_after_alloc(Req("n1", prompt(13)), Blocks([30, 31, 32, 33]), 0)
    assert s.build_connector_meta(None).pool == []


def test_pool_lookup_failure_backs_off(clock):
    pool = Pool(pooled=3, fail=True)
    s = side(pool, pool_backoff_s=5)
    assert s.get_num_new_matched_tokens(Req("n1", prompt(13)), 0) == (0, False)
    pool.fail = False
    clock.mono += 4.9
    assert s.get_num_new_matched_tokens(Req("n2", prompt(13)), 0) == (0, False)
    assert len(pool.asked) == 1  # skipped during the back-off
    clock.mono += 0.2
    assert s.get_num_new_matched_tokens(Req("n3", prompt(13)), 0) == (12, True)


def test_pool_load_that_cannot_be_planned_is_a_failed_job(clock):
    s = side(Pool(pooled=2))
    req = Req("n1", prompt(13))
    assert s.get_num_new_matched_tokens(req, 0) == (8, True)
    s.update_state_after_alloc(req, Blocks([30]), 8)  # 1 block allocated for 2 pooled
    assert s.build_connector_meta(None).pool == [PoolJob("n1", (), (30,), False, error="plan")]


def test_pool_save_holds_a_finished_request_s_full_blocks(clock):
    s = side(Pool())
    req = Req("f1", prompt(9), None, Status.FINISHED_STOPPED, num_computed_tokens=10, output_token_ids=[1, 2])
    assert s.request_finished(req, [40, 41, 42]) == (True, None)
    keys = block_hashes(prompt(9) + [1], BS)  # the computed tokens: 2 full blocks
    meta = s.build_connector_meta(None)
    assert meta.pool == [PoolJob("f1", tuple(keys), (40, 41), True)] and meta.send == {}
    idle = SimpleNamespace(total_num_scheduled_tokens=0)
    s.build_connector_meta(idle)
    assert clock.sleeps == [s.config.idle_wait_ms / 1e3]  # blocks held for the save
    s.update_connector_output(worker_meta(pool={"f1": "saved"}))
    s.build_connector_meta(idle)
    assert len(clock.sleeps) == 1 and s.pool_outcomes == {"saved": 1}


def test_pool_save_and_lease_together(clock):
    s = side(Pool())
    delay, params = p_finished(s)
    assert delay and params["remote_block_ids"] == [7, 8, 9]
    meta = s.build_connector_meta(None)
    assert meta.send == {"p1": NOW + 30.0}
    assert meta.pool == [PoolJob("p1", tuple(block_hashes(prompt(10), BS)), (7, 8), True)]


@pytest.mark.parametrize("case", ["aborted", "save_off", "too_few_blocks", "no_full_block"])
def test_pool_save_declines(clock, case):
    s = side(Pool(), **({"pool_save": False} if case == "save_off" else {}))
    status = Status.FINISHED_ABORTED if case == "aborted" else Status.FINISHED_STOPPED
    n = 3 if case == "no_full_block" else 9
    blocks = [40] if case == "too_few_blocks" else [40, 41, 42]
    assert s.request_finished(Req("f1", prompt(n), None, status, num_computed_tokens=n), blocks) == (False, None)
    assert s.build_connector_meta(None).pool == []


def test_a_failed_pool_load_is_not_claimed_again_for_that_request(clock):
    """Issue 27: a corrupt or foreign pool object stays listed; vLLM reschedules the request after the failed load,
    and claiming the pool again would load the same object forever."""
    pool = Pool(pooled=2)
    s = side(pool)
    req = Req("r1", prompt(10))
    assert s.get_num_new_matched_tokens(req, 0) == (8, True)
    s.update_state_after_alloc(req, Blocks([1, 2, 3]), 8)
    s.build_connector_meta(None)
    s.update_connector_output(worker_meta(pool={"r1": "load_partial"}))
    assert s.get_num_new_matched_tokens(req, 4) == (0, False)
    assert s.get_num_new_matched_tokens(Req("r2", prompt(10)), 0) == (8, True)  # another request may try
    req.status = Status.FINISHED_STOPPED
    s.request_finished(req, [1, 2, 3])
    assert s.get_num_new_matched_tokens(req, 0) == (8, True)  # the id is forgotten once the request ends


def test_p_hands_a_traced_leases_traceparent_to_its_worker(clock):
    """P's lease span (pdserve/vllm/worker.py, pdserve.kv_lease) needs the request's traceparent on the worker side:
    the scheduler sends it beside the lease, once, and only for a traced request."""
    s = side()
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    traced = Req("p1", prompt(10), {"do_remote_decode": True}, Status.FINISHED_STOPPED, 10)
    traced.trace_headers = {"traceparent": tp}  # type: ignore[attr-defined]  # as vLLM keeps the router's
    s.request_finished(traced, [7, 8, 9, 10])
    s.request_finished(Req("p2", prompt(10), {"do_remote_decode": True}, Status.FINISHED_STOPPED, 10), [1, 2, 3, 4])
    meta = s.build_connector_meta(None)
    assert set(meta.send) == {"p1", "p2"} and meta.send_trace == {"p1": tp}
    assert s.build_connector_meta(None).send_trace == {}  # handed over once
