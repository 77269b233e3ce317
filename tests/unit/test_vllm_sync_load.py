"""Issue 16, item 2: D loads small KV reads synchronously (inside the step that computes its first token) and
large ones asynchronously; the hand-off's timestamps. Scheduler half with small fakes (no vLLM), the worker
half's result accounting with a fake transfer engine (vLLM imported only for its result type).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.vllm.messages import PdserveHandshake, PdserveMeta, PdserveWorkerMeta, RecvJob
from pdserve.vllm.params import BlockPlan, ConfigError, ConnectorConfig, RemoteParams, prompt_hash
from pdserve.vllm.scheduler import SchedulerSide
from pdserve.vllm.stamps import HandoffStamps

SECRET = "0123456789abcdef-secret"
BS = 4
BLOCK_BYTES = 1000  # one block over every layer


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    max_tokens: int = 16
    arrival_time: float = 0.0
    num_computed_tokens: int = 0
    status: Any = None
    sampling_params: Any = field(init=False)

    def __post_init__(self) -> None:
        self.sampling_params = SimpleNamespace(max_tokens=self.max_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.blocks = ([SimpleNamespace(block_hash=None) for _ in ids],)

    def get_block_ids(self) -> list[list[int]]:
        return [list(self.ids)]


def side(block_bytes: int = BLOCK_BYTES, **extra: Any) -> SchedulerSide:
    s = SchedulerSide(ConnectorConfig.from_extra({"secret": SECRET, **extra}), BS)
    s.set_handshake({0: PdserveHandshake("engine-p", "10.0.0.1", 7000, "float32/bs4/L2/abc",
                                         block_bytes=block_bytes)})
    return s


def d_request(n_prompt: int, rid: str = "d1", **params: Any) -> Req:
    prompt = list(range(1, n_prompt + 1))
    remote = RemoteParams("engine-p", "10.0.0.1", 7000, tuple(range(100, 100 + -(-n_prompt // BS))), n_prompt,
                          "p1", "float32/bs4/L2/abc", prompt_hash(prompt, n_prompt))
    return Req(rid, prompt + [999], {**remote.to_params(), **params}, arrival_time=time.time())


def test_config_validates_the_threshold():
    assert ConnectorConfig.from_extra({"secret": SECRET}).sync_load_max_bytes == 32 << 20
    assert ConnectorConfig.from_extra({"secret": SECRET, "sync_load_max_bytes": 0}).sync_load_max_bytes == 0
    with pytest.raises(ConfigError, match="sync_load_max_bytes"):
        ConnectorConfig.from_extra({"secret": SECRET, "sync_load_max_bytes": -1})
    with pytest.raises(ConfigError, match="sync_load_max_bytes"):
        ConnectorConfig.from_extra({"secret": SECRET, "sync_load_max_bytes": "lots"})
    with pytest.raises(ConfigError, match="sync_load_deadline_s"):
        ConnectorConfig.from_extra({"secret": SECRET, "sync_load_deadline_s": 0})


def test_pdserve_load_is_validated():
    req = d_request(8, pdserve_load="sometimes")
    with pytest.raises(ValueError, match="pdserve_load"):
        RemoteParams.parse(req.kv_transfer_params, BS)
    assert RemoteParams.parse(d_request(8, pdserve_load="async").kv_transfer_params, BS).load == "async"


def test_small_read_is_synchronous_and_planned_for_this_step():
    s = side()
    req = d_request(10)  # 10 prompt tokens from P: 3 blocks of 1000 B
    assert s.get_num_new_matched_tokens(req, 0) == (10, False)  # load_kv_async False: scheduled at once
    s.update_state_after_alloc(req, Blocks([7, 8, 9]), 10)
    meta = s.build_connector_meta(None)
    assert len(meta.recv) == 1 and meta.recv[0].sync and meta.recv[0].load
    assert meta.recv[0].plan == BlockPlan((7, 8, 9), (100, 101, 102))
    assert s.reading == 1


@pytest.mark.parametrize("limit, expect_async", [(3000, False), (2999, True), (0, True)])
def test_threshold_is_the_bytes_this_rank_reads(limit, expect_async):
    s = side(sync_load_max_bytes=limit)
    assert s.get_num_new_matched_tokens(d_request(10), 0) == (10, expect_async)


def test_local_prefix_hit_counts_only_the_blocks_read():
    s = side(sync_load_max_bytes=2000)
    # 4 tokens (1 block) are D's own: 6 more tokens = 2 blocks read = 2000 B
    assert s.get_num_new_matched_tokens(d_request(10), 4) == (6, False)


@pytest.mark.parametrize("why", ["forced", "one_token", "unknown_block_size"])
def test_async_when_forced_one_token_or_size_unknown(why):
    s = side(block_bytes=0 if why == "unknown_block_size" else BLOCK_BYTES)
    req = d_request(10, pdserve_load="async") if why == "forced" else d_request(10)
    if why == "one_token":
        req.sampling_params.max_tokens = 1
    assert s.get_num_new_matched_tokens(req, 0) == (10, True)
    s.update_state_after_alloc(req, Blocks([7, 8, 9]), 10)
    assert not s.build_connector_meta(None).recv[0].sync


def test_sync_plan_error_marks_the_blocks_to_recompute():
    s = side()
    req = d_request(10)
    assert s.get_num_new_matched_tokens(req, 0) == (10, False)
    s.update_state_after_alloc(req, Blocks([7]), 10)  # too few local blocks: the plan fails
    job = s.build_connector_meta(None).recv[0]
    assert job.sync and job.error and job.plan.local == (7,)  # reported invalid: vLLM recomputes


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_stamps_sync_order_and_one_line():
    st = HandoffStamps(Clock())
    st.admit("d", 99.5, True, "p", "h", 10)  # admit 101
    st.alloc("d")  # 102
    st.step(["d"])  # sched 103
    st.drop("d")  # finished in its load step: kept until its read is heard of
    st.read("d", {"t0": 103.2, "t1": 103.4, "bytes": 3000, "ms": 0.2, "ok": True})  # seen 104
    assert not st.written
    st.step([])  # done 105 -> written
    (line,) = st.written
    assert line["mode"] == "sync" and line["arrive"] == 99.5
    assert [line[k] for k in ("admit", "alloc", "sched", "seen", "done")] == [101, 102, 103, 104, 105]
    assert line["read_start"] == 103.2 and line["bytes"] == 3000


def test_stamps_async_written_after_the_first_computed_step():
    st = HandoffStamps(Clock())
    st.admit("d", 100.0, False, "p", "h", 10)
    st.alloc("d")
    st.step([])  # the admission step: nothing scheduled for d
    st.read("d", {"t0": 103.5, "t1": 103.6, "bytes": 1, "ms": 0.1, "ok": True, "layerwise": 2, "layers_early": 1,
                  "spans": [[103.5, 103.51], [103.59, 103.6]], "busy_ms": 20.0})
    st.step(["d"])
    assert not st.written
    st.step([])
    (line,) = st.written
    assert line["mode"] == "async" and line["seen"] < line["sched"] < line["done"]
    assert (line["layerwise"], line["layers_early"], len(line["spans"])) == (2, 1, 2)  # a layer-wise read's facts


def test_stamps_forget_a_request_never_allocated():
    st = HandoffStamps(Clock())
    st.admit("d", 100.0, False, "p", "h", 10)
    st.drop("d")
    st.step(["d"])
    st.step([])
    assert not st.written and not st._pending


# ---- worker half: a synchronous read runs inside start_load_kv and reports no finished_recving ----

class FakeHandle:
    def __init__(self, fail: bool, delay: float) -> None:
        self.fail, self.delay, self.total_bytes = fail, delay, 3000

    def result(self) -> None:
        time.sleep(self.delay)
        if self.fail:
            raise OSError("connection refused")


class FakeEngine:
    def __init__(self, fail: bool = False, delay: float = 0.0) -> None:
        self.fail, self.delay, self.submitted = fail, delay, []

    def submit(self, peer: Any, entries: list, op: str, notify: Any = None, deadline_s: float = 0.0,
               on_frame: Any = None) -> FakeHandle:
        self.submitted.append((entries, notify, deadline_s))
        return FakeHandle(self.fail and bool(entries), self.delay)

    def fetch_segment(self, host: str, port: int) -> Any:
        return SimpleNamespace(engine_id="engine-p")


def worker(engine: FakeEngine, **extra: Any) -> Any:
    pytest.importorskip("vllm")
    from pdserve.vllm.release import ReleaseLedger
    from pdserve.vllm.worker import WorkerSide

    w = WorkerSide.__new__(WorkerSide)  # no transfer engine, no KV cache: only the read path
    w.config = ConnectorConfig.from_extra({"secret": SECRET, "kv_checksum": False, **extra})  # no P to answer sums
    w.engine, w.rank, w.tp, w.kv_heads, w.layout, w.layers, w.block_size = engine, 0, 1, 2, "", [], BS
    w._peers, w._lock, w._inflight, w._done, w._invalid = {}, threading.Lock(), {}, [], set()
    w._meta, w._ledger, w._pool_done = PdserveWorkerMeta(), ReleaseLedger(early_ttl_s=600), []
    from pdserve.vllm.metrics import PdserveStats
    w.stats = PdserveStats()
    from pdserve.vllm.integrity import SealTable
    w._seals = SealTable()
    from pdserve.vllm.handoff_board import HandoffBoard
    w._board = HandoffBoard("engine-p", lambda *a: None)
    w._batches = lambda remote, job: {0: [("layer", 0, "layer", 0, 3000)]}
    from pdserve.vllm.fence import DeviceFence
    w._fence, w._cuda, w._by_layer = DeviceFence(), False, False  # host memory, no layer-wise reads
    return w


def job(sync: bool) -> RecvJob:
    remote = RemoteParams.parse(d_request(10).kv_transfer_params, BS)
    return RecvJob("d1", remote, BlockPlan((7, 8, 9), (100, 101, 102)), sync=sync)


@pytest.mark.parametrize("sync", [True, False])
def test_worker_reports_a_read_by_its_mode(sync):
    w = worker(FakeEngine(delay=0.05))
    w.start(PdserveMeta([job(sync)]))
    if sync:  # the read ended before start_load_kv returned
        assert len(w._done) == 1
    else:
        time.sleep(0.3)
    res = w.results()
    assert res.finished_recving == (set() if sync else {"d1"}) and not res.failed_recving
    assert w.take_invalid_blocks() == set()
    stats = w.take_worker_meta().reads["d1"]
    assert stats["ok"] and stats["mode"] == ("sync" if sync else "async") and stats["t1"] >= stats["t0"]


def test_failed_sync_read_reports_only_invalid_blocks():
    engine = FakeEngine(fail=True)
    w = worker(engine, sync_load_deadline_s=0.5)
    w.start(PdserveMeta([job(True)]))
    res = w.results()
    assert not res.finished_recving and not res.failed_recving  # the request is running: vLLM recomputes
    assert w.take_invalid_blocks() == {7, 8, 9}
    assert w.take_worker_meta().reads["d1"]["ok"] is False
    assert engine.submitted[0][2] <= 0.5  # the sync deadline, not transfer_deadline_s


def test_read_stats_merge_over_ranks_keeps_the_span():
    from pdserve.vllm.messages import merge_reads

    a = {"bytes": 10, "ms": 2.0, "ok": True, "ranks": 1, "t0": 5.0, "t1": 5.002, "mode": "sync"}
    b = {"bytes": 10, "ms": 3.0, "ok": True, "ranks": 1, "t0": 5.001, "t1": 5.004, "mode": "sync"}
    m = merge_reads(a, b)
    assert (m["t0"], m["t1"], m["bytes"], m["ms"], m["ranks"]) == (5.0, 5.004, 20, 3.0, 2)
