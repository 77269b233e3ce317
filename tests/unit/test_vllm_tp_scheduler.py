"""The scheduler half with tensor-parallel ranks: P's hand-off names every rank, D reports a read once all of
its ranks have, and a P layout D's ranks cannot slice is refused with both layouts named."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.vllm.messages import PdserveHandshake, PdserveWorkerMeta
from pdserve.vllm.params import ConnectorConfig, RemoteParams, prompt_hash
from pdserve.vllm.scheduler import SchedulerSide

SECRET = "0123456789abcdef-secret"
BS = 4


class Status(enum.Enum):
    RUNNING = 1
    FINISHED_LENGTH_CAPPED = 3


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


def _hs(rank: int, unit: str = "float32/bs4/L2/unit/u1") -> PdserveHandshake:
    return PdserveHandshake(f"eng-{rank}", "10.0.0.1", 7000 + rank, "float32/bs4/L2/runs1x512/abc", rank, 2, unit)


def _side(tp: int, unit: str = "float32/bs4/L2/unit/u1") -> SchedulerSide:
    s = SchedulerSide(ConnectorConfig.from_extra({"secret": SECRET}), BS, None, tp=tp)
    s.set_handshake({r: _hs(r, unit) for r in range(tp)})
    return s


def test_p_hand_off_names_every_rank():
    s = _side(2)
    req = Req("p1", list(range(10)), {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED, 10)
    delay, params = s.request_finished(req, [7, 8, 9])
    assert delay and params is not None
    assert params["remote_ranks"] == [["eng-0", "10.0.0.1", 7000], ["eng-1", "10.0.0.1", 7001]]
    assert params["remote_kv_heads"] == 2 and params["remote_kv_unit"] == "float32/bs4/L2/unit/u1"
    assert s.held == 1 and s.build_connector_meta(None).send.keys() == {"p1"}
    # both ranks' lease ends (in different steps) end the hold once
    s.update_connector_output(_out(released={"p1": "notified"}))
    s.update_connector_output(_out(released={"p1": "notified"}))
    assert s.held == 0


def test_p_without_every_ranks_handshake_does_not_hand_off():
    s = SchedulerSide(ConnectorConfig.from_extra({"secret": SECRET}), BS, None, tp=2)
    s.set_handshake({0: _hs(0)})
    req = Req("p1", list(range(10)), {"do_remote_decode": True}, Status.FINISHED_LENGTH_CAPPED, 10)
    assert s.request_finished(req, [7, 8, 9]) == (False, None)


class _Out:
    def __init__(self, meta: PdserveWorkerMeta) -> None:
        self.kv_connector_worker_meta = meta


def _out(**kw: Any) -> _Out:
    return _Out(PdserveWorkerMeta(**kw))


def _remote(p_tp: int, unit: str = "float32/bs4/L2/unit/u1", heads: int = 2) -> dict[str, Any]:
    ranks = tuple((f"eng-{r}", "10.0.0.1", 7000 + r) for r in range(p_tp)) if p_tp > 1 else ()
    layout = "float32/bs4/L2/runs1x512/abc" if p_tp == 2 else "float32/bs4/L2/runs1x1024/def"
    return RemoteParams("eng-0", "10.0.0.1", 7000, (7, 8, 9), 10, "p1", layout,
                        prompt_hash(list(range(10)), 10), time.time() + 30, "", ranks, heads, unit).to_params()


def test_d_reports_a_read_once_every_rank_has():
    s = _side(2)
    req = Req("d1", list(range(11)), _remote(2))
    assert s.get_num_new_matched_tokens(req, 0) == (10, True)
    s.reading = 1
    rank0 = {"bytes": 100, "ms": 3.0, "ok": True, "blocks": 3, "ranks": 1, "per_rank": {0: [100, 3.0]}}
    rank1 = {"bytes": 100, "ms": 5.0, "ok": True, "blocks": 3, "ranks": 1, "per_rank": {1: [100, 5.0]}}
    s.update_connector_output(_out(reads={"d1": rank0}))
    assert s.reading == 1 and "d1" not in s._reads
    s.update_connector_output(_out(reads={"d1": rank1}))
    assert s.reading == 0
    _, out = s.request_finished(Req("d1", list(range(11)), {"do_remote_prefill": False}), [])
    assert out == {"pdserve": {"bytes": 200, "ms": 5.0, "ok": True, "blocks": 3, "ranks": 2,
                               "per_rank": {0: [100, 3.0], 1: [100, 5.0]}}}


def test_d_with_another_tp_reads_head_slices_when_layouts_match():
    s = _side(1)
    req = Req("d1", list(range(11)), _remote(2))
    assert s.get_num_new_matched_tokens(req, 0) == (10, True)


def test_d_refuses_a_p_layout_it_cannot_slice_naming_both():
    s = _side(1)
    req = Req("d1", list(range(11)), _remote(2, unit="float32/bs4/L2/unit/OTHER"))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    _, out = s.request_finished(Req("d1", list(range(11)), {"do_remote_prefill": False}), [])
    refused = out["pdserve"]["refused"]
    assert "P tp=2 x 2 KV heads" in refused and "D tp=1 x 2 KV heads" in refused and "OTHER" in refused
    assert out["pdserve"]["ok"] is False
    s2 = _side(2)
    req = Req("d2", list(range(11)), _remote(1, heads=3))  # a model with other heads
    assert s2.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "different models" in s2._reads["d2"]["refused"]
