"""D continues an early hand-off after P's first token (issue 37; pdserve/vllm/continuation.py): on vLLM 0.32's own
Request and stop check, the request becomes the serial D's (prompt + [t1], one token less, min_tokens less one, the
block hashes of prompt + [t1]); a D that cannot continue stops after one token marked ``pdserve_no_continue``, a stop
token included. And the connector's two halves: P holds its announcement until it sampled t1 and sends it then; D's
scheduler claims the whole prompt, continues when its read's stats carry t1 and marks the request otherwise."""

from __future__ import annotations

import hashlib
import pickle
import time
from dataclasses import replace
from typing import Any

import pytest

from pdserve.vllm.continuation import NO_CONTINUE, cannot_continue, continue_after
from pdserve.vllm.messages import ReadyNote
from pdserve.vllm.params import prompt_hash
from tests.unit.test_early_dispatch import P_URL, p_answer, side
from tests.unit.test_vllm_prefill_seals import output
from tests.unit.test_vllm_scheduler import Blocks, Req, Status, prompt

vllm = pytest.importorskip("vllm")
BS = 4


def sha(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj)).digest()


def d_request(n: int, max_tokens: int = 5, min_tokens: int = 0, stop: list[int] | None = None,
              params: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha)
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop or [], temperature=0,
                        extra_args={"kv_transfer_params": params} if params else None)
    return Request(f"d{n}", prompt(n), sp, None, block_hasher=get_request_block_hasher(BS, sha))


def generate(request: Any, tokens: list[int]) -> list[int]:
    """vLLM's own per-token stop check (Scheduler._update_request_with_output) over ``tokens``: those kept."""
    from vllm.v1.core.sched.utils import check_stop

    kept = []
    for t in tokens:
        request.append_output_token_ids(t)
        kept.append(t)
        if check_stop(request, 4096):
            break
    return kept


def test_a_continuing_request_is_the_serial_d_s_prompt_plus_p_s_token_with_one_token_less():
    req = d_request(11, max_tokens=5, min_tokens=3)
    assert continue_after(req, 7)
    assert req.prompt_token_ids == prompt(11) + [7] and list(req.all_token_ids) == prompt(11) + [7]
    assert req.num_prompt_tokens == req.num_tokens == 12 and req.num_output_tokens == 0
    assert req.max_tokens == 4 and req.sampling_params.min_tokens == 2
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request
    fresh = Request("s", prompt(11) + [7], req.sampling_params, None, block_hasher=get_request_block_hasher(BS, sha))
    assert req.block_hashes == fresh.block_hashes and len(req.block_hashes) == 3  # the third block is full now
    assert generate(req, [1, 2, 3, 4, 5]) == [1, 2, 3, 4]  # max_tokens counts P's token


def test_min_tokens_and_stop_tokens_count_p_s_token_as_one_worker_does():
    req = d_request(10, max_tokens=6, min_tokens=2, stop=[9])
    assert continue_after(req, 5) and req.sampling_params.min_tokens == 1
    assert generate(req, [4, 9, 3]) == [4, 9] and req.stop_reason == 9  # a stop token as t2 ends it as t2


def test_a_request_that_cannot_continue_gives_one_marked_token_even_a_stop_token():
    for last in (9, 3):
        req = d_request(10, max_tokens=6, stop=[9])
        cannot_continue(req, "test")
        assert generate(req, [last, 4]) == [last] and req.stop_reason == NO_CONTINUE
        assert req.get_finished_reason() is not None


def test_continue_refuses_what_it_cannot_make_exact():
    req = d_request(10, max_tokens=1)
    assert not continue_after(req, 5) and req.num_prompt_tokens == 10  # P's token is the whole output
    req = d_request(10)
    req.append_output_token_ids(3)
    assert not continue_after(req, 5) and req.num_prompt_tokens == 10  # it generated already


# ---- P: the blocks at the forward, the first token once sampled ----
def p_request(hid: str) -> Req:
    return Req("p1", prompt(14), {"do_remote_decode": True, "lease_on_stop": False, "pdserve_handoff": hid,
                                  "pdserve_continue": True})


def p_prefilled(s: Any, hid: str) -> Req:
    req = p_request(hid)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # (vLLM asks P's connector too: not D's to mark)
    s.update_state_after_alloc(req, Blocks([1, 2, 3, 4]), 0)
    meta = s.build_connector_meta(output({"p1": 14}, new=[("p1", [1, 2, 3, 4], 0)]))
    note = meta.ready[hid]  # the forward completes the prompt: D may read at once; t1 is not sampled yet
    assert note is not None and note.first_token is None and meta.announce == {}
    return req


def test_p_announces_the_blocks_at_the_forward_and_its_first_token_once_sampled():
    s, hid = side(), "hoff-" + "a" * 32
    req = p_prefilled(s, hid)
    req.status, req.num_computed_tokens, req.output_token_ids = Status.FINISHED_LENGTH_CAPPED, 14, [77]
    delay, params = s.request_finished(req, [1, 2, 3, 4])
    assert delay and params is not None and not hasattr(req, "stop_reason")  # leased: D reads it
    assert s.has_pending_announcements()  # the connector asks vLLM for a step (has_pending_push_work)
    note = s.build_connector_meta(None).announce[hid]
    assert not s.has_pending_announcements()
    assert note is not None and note.first_token == 77 and note.blocks == (1, 2, 3, 4) and note.num_tokens == 14
    assert ReadyNote.from_wire(note.to_wire()) == note and note.prompt_hash == prompt_hash(prompt(14), 14)


def test_p_says_there_is_no_token_to_continue_after_when_its_token_stopped_the_request():
    s, hid = side(), "hoff-" + "b" * 32
    req = p_prefilled(s, hid)
    req.status, req.num_computed_tokens, req.output_token_ids = Status.FINISHED_STOPPED, 14, [2]
    delay, params = s.request_finished(req, [1, 2, 3, 4])
    assert delay and params is not None  # announced: leased whatever way it ended (D may be reading)
    assert s.build_connector_meta(None).announce == {hid: None}


def test_the_board_answers_d_s_second_question_with_p_s_token_or_why_not():
    from pdserve.vllm.handoff_board import TOKEN_PREFIX, HandoffBoard, parse_wait, wait_message

    board, hid = HandoffBoard("e", lambda *a: None), "hoff-" + "f" * 32
    note = ReadyNote("p1", (1,), 4, "h", time.time() + 60)
    board.ready(hid, note)
    assert board.wait_token(hid, "e", 0.01)["ok"] is False  # not sampled yet
    board.ready(hid, replace(note, first_token=9))
    assert board.wait_token(hid, "e", 0.01) == {"ok": True, "t1": 9}
    assert board.wait_token(hid, "other", 1.0)["ok"] is False  # P restarted
    board.ready(hid + "0", note)
    board.no_token(hid + "0")
    assert "without a first token" in board.wait_token(hid + "0", "e", 5.0)["why"]  # answered at once
    assert parse_wait(wait_message(hid, "e", 2.0, TOKEN_PREFIX), TOKEN_PREFIX) == (hid, "e", 2.0)
    assert parse_wait(wait_message(hid, "e", 2.0, TOKEN_PREFIX)) is None  # not the first question


# ---- D: claim the whole prompt, continue once the read ends with t1 ----
def d_side_request(n: int = 14, max_tokens: int = 5) -> tuple[Any, Any]:
    from vllm.v1.request import RequestStatus

    from pdserve.router.run.early_dispatch import EngineBook

    book = EngineBook()
    book.learn(P_URL, p_answer())
    params = {**book.decode_params(P_URL, "hoff-" + "c" * 32, n), "pdserve_continue": True}
    s, req = side(), d_request(n, max_tokens=max_tokens, params=params)
    assert s.get_num_new_matched_tokens(req, 4) == (n - 4, True)  # the whole prompt: t1 is the token D computes
    s.update_state_after_alloc(req, Blocks([5, 6, 7, 8], hashed=1), n - 4)
    (job,) = s.build_connector_meta(output({})).recv
    assert job.plan.local == (6, 7, 8) and job.first_block == 1
    req.status, req.num_computed_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, n
    return s, req


def read_done(s: Any, req: Any, **stats: Any) -> None:
    from pdserve.vllm.messages import PdserveWorkerMeta

    class Out:
        kv_connector_worker_meta = PdserveWorkerMeta(reads={req.request_id: {
            "ok": True, "bytes": 1, "ms": 1.0, "blocks": 3, "t0": time.time(), "t1": time.time(), **stats}})

    s.update_connector_output(Out())


def test_d_continues_after_the_token_p_answered_with_and_stamps_it():
    s, req = d_side_request()
    read_done(s, req, first_token=77)
    assert req.prompt_token_ids == prompt(14) + [77] and req.max_tokens == 4 and s.continued == 1
    assert req.num_computed_tokens == 14 < req.num_tokens  # vLLM computes t1's position only: no token regenerated
    assert s.stamps._pending[req.request_id]["continued"] == 77


def test_d_whose_read_ended_without_p_s_token_is_marked():
    s, req = d_side_request()
    read_done(s, req, ok=False, error="handoff: P rank 0 has no KV")
    assert req.num_prompt_tokens == 14 and req.max_tokens == 1 and req.stop_reason == NO_CONTINUE
    assert s.continued == 0


def test_d_that_reads_nothing_is_marked_at_once():
    from pdserve.router.run.early_dispatch import EngineBook

    book = EngineBook()
    book.learn(P_URL, p_answer())
    params = {**book.decode_params(P_URL, "hoff-" + "d" * 32, 14), "pdserve_continue": True,
              "remote_engine_id": None}  # malformed: D computes the prompt itself
    s, req = side(), d_request(14, params=params)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.max_tokens == 1 and req.stop_reason == NO_CONTINUE


def test_p_s_token_survives_the_merge_of_tensor_parallel_ranks_reads():
    from pdserve.vllm.messages import merge_reads

    a = {"bytes": 1, "ms": 1.0, "ok": True, "ranks": 1}
    for mine, other in ((a, {**a, "first_token": 5}), ({**a, "first_token": 5}, a)):
        assert merge_reads(mine, other)["first_token"] == 5
