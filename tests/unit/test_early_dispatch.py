"""Early dispatch to D (issue 37): the router's half (the hand-off id, P's engine address from its earlier answers,
which sampling may go early) and the connector's (P's scheduler announces the blocks in the step that completes the
prompt, leases them whatever way the request ends once announced, tells D when it never will; P's worker answers
D's rendezvous; D's scheduler plans an async read of the blocks it lacks, P's ids still unknown; D's worker checks
P's answer against its own prompt before reading).

No vLLM: the scheduler output and requests are the fakes of the scheduler tests."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from pdserve.router.run.early_dispatch import EngineBook, early_allowed, new_handoff_id
from pdserve.vllm.handoff_board import HandoffBoard, parse_wait, wait_message
from pdserve.vllm.messages import ReadyNote
from pdserve.vllm.params import ConnectorConfig, RemoteParams, prompt_hash
from pdserve.vllm.scheduler import SchedulerSide
from tests.unit.test_vllm_prefill_seals import output
from tests.unit.test_vllm_scheduler import HS, SECRET, Blocks, Req, Status, prompt

BS = 4
P_URL = "http://127.0.0.1:9001"


def p_answer(**over: Any) -> dict[str, Any]:
    return {**RemoteParams(HS.engine_id, HS.host, HS.port, (7, 8, 9), 10, "p1", HS.layout).to_params(), **over}


# ---- the router's half ----
def test_the_book_knows_a_p_only_after_its_answer_and_forgets_it_when_it_fails():
    book = EngineBook()
    hid = new_handoff_id()
    assert book.decode_params(P_URL, hid, 10) is None  # the first request to a P goes the serial way
    book.learn(P_URL, p_answer())
    d = book.decode_params(P_URL, hid, 10)
    assert d is not None and d["pdserve_handoff"] == hid and d["remote_request_id"] == hid
    assert (d["remote_engine_id"], d["remote_host"], d["remote_port"]) == (HS.engine_id, HS.host, HS.port)
    assert d["remote_block_ids"] == [] and d["remote_num_tokens"] == 10
    parsed = RemoteParams.parse(d, BS)  # D's connector reads it: no block ids yet, the hand-off id instead
    assert parsed.handoff == hid and parsed.block_ids == ()
    book.forget(P_URL)
    assert P_URL not in book
    book.learn(P_URL, p_answer(remote_group_blocks=[[0, [1]]]))  # a hybrid KV cache: never early
    book.learn(P_URL, None)
    assert P_URL not in book
    book.learn(P_URL, p_answer())
    book.learn(P_URL, p_answer(pdserve_no_early=True))  # an engine without prefix caching (MLA on CPU): serial
    assert P_URL not in book


def test_p_without_prefix_caching_says_its_hand_offs_are_serial():
    """vLLM's MLA on CPU runs without prefix caching: a D like it continues only P's whole prompt exactly, so P's
    answer tells the router to keep its hand-offs serial (D would otherwise compute the early prompt itself)."""
    from tests.unit.test_vllm_scheduler import p_finished, side

    for caching, flagged in ((True, False), (False, True)):
        delay, params = p_finished(side(prefix_caching=caching))
        assert delay and params is not None and bool(params.get("pdserve_no_early")) is flagged


def test_p_says_when_it_announces_layers_as_its_forward_writes_them():
    """A P whose worker reads and writes host memory with layerwise_kv says so in its answers (pdserve_layerwise);
    one that does not (a device's memory, layerwise_kv off) says nothing."""
    from dataclasses import replace

    from tests.unit.test_vllm_scheduler import HS as SCHED_HS
    from tests.unit.test_vllm_scheduler import p_finished, side

    for layerwise in (False, True):
        s = side()
        s.set_handshake({0: replace(SCHED_HS, layerwise=layerwise)})
        delay, params = p_finished(s)
        assert delay and params is not None and (params.get("pdserve_layerwise") is True) is layerwise


def test_auto_regenerates_a_greedy_first_token_only_where_p_sends_layer_by_layer():
    """--early-continue auto: D regenerates t1 (no wait for P's token) where P's last answer said it announces layers
    as it writes them and sampling is greedy; it continues after P's token otherwise (other sampling, a P that reads
    whole, a P the book forgot). always and never do what they say."""
    book = EngineBook()
    book.learn(P_URL, p_answer())
    assert book.continues(P_URL, {"temperature": 0.0})  # a whole read: continuing is the faster
    book.learn(P_URL, p_answer(pdserve_layerwise=True))
    assert not book.continues(P_URL, {"temperature": 0.0})
    assert book.continues(P_URL, {"temperature": 0.8}) and book.continues(P_URL, {})  # D's t1 would be its own sample
    assert book.continues("http://127.0.0.1:9002", {"temperature": 0.0})  # another P
    book.learn(P_URL, p_answer())  # P restarted with layerwise_kv off
    assert book.continues(P_URL, {"temperature": 0.0})
    book.learn(P_URL, p_answer(pdserve_layerwise=True))
    book.forget(P_URL)
    book.learn(P_URL, p_answer(pdserve_layerwise="yes"))  # only True counts
    assert book.continues(P_URL, {"temperature": 0.0})
    book.learn(P_URL, p_answer(pdserve_layerwise=True))
    assert EngineBook("always").continues(P_URL, {"temperature": 0.0})
    never = EngineBook("never")
    never.learn(P_URL, p_answer())
    assert not never.continues(P_URL, {"temperature": 0.8})
    with pytest.raises(ValueError, match="auto, always, never"):
        EngineBook("sometimes")


def test_auto_sends_a_greedy_request_from_a_layer_wise_p_early_without_continuation():
    """Through the router's generation: the same output, D told to regenerate (no pdserve_continue to P or D) for a
    greedy request from a layer-wise P, told to continue for a sampled one."""
    book_placement.clear()
    book, client = EngineBook(), PDClient()
    book.learn(P0, p_answer(pdserve_layerwise=True))
    assert asyncio.run(run_all(pd_run(client, "r1", book))) == [7, 100, 101, 102]
    calls = dict(client.calls)
    assert "pdserve_handoff" in calls[D0]["kv_transfer_params"]
    assert "pdserve_continue" not in calls[D0]["kv_transfer_params"]
    assert "pdserve_continue" not in calls[P0]["kv_transfer_params"]
    client.calls.clear()
    assert asyncio.run(run_all(pd_run(client, "r2", book, temperature=0.8))) == [7, 100, 101, 102]
    calls = dict(client.calls)
    assert calls[D0]["kv_transfer_params"]["pdserve_continue"] is True
    assert calls[P0]["kv_transfer_params"]["pdserve_continue"] is True


def test_only_sampling_under_which_d_s_first_token_is_p_s_goes_early():
    assert early_allowed({"temperature": 0}, True) and early_allowed({"temperature": 0.0}, True)
    assert not early_allowed({}, True)  # vLLM's default samples
    assert not early_allowed({"temperature": 0.7}, True) and not early_allowed({"temperature": True}, True)
    assert early_allowed({"temperature": 0.7, "seed": 1}, False)  # D samples every token itself


def test_a_hand_off_id_is_refused_unless_it_is_one():
    with pytest.raises(ValueError, match="pdserve_handoff"):
        RemoteParams.parse({**p_answer(), "pdserve_handoff": "p1"}, BS)


# ---- P's scheduler ----
def side() -> SchedulerSide:
    s = SchedulerSide(ConnectorConfig.from_extra({"secret": SECRET}), BS)
    s.set_handshake({0: HS})
    return s


def test_p_announces_the_blocks_in_the_step_that_completes_the_prompt_and_leases_them():
    s, hid = side(), new_handoff_id()
    req = Req("p1", prompt(14), {"do_remote_decode": True, "lease_on_stop": False, "pdserve_handoff": hid})
    s.update_state_after_alloc(req, Blocks([1, 2]), 0)
    assert s.build_connector_meta(output({"p1": 8}, new=[("p1", [1, 2], 0)])).ready == {}  # a first chunk
    meta = s.build_connector_meta(output({"p1": 6}, cached=[("p1", [3, 4], 8)]))
    note = meta.ready[hid]
    assert note is not None and note.req_id == "p1" and note.blocks == (1, 2, 3, 4) and note.num_tokens == 14
    assert note.prompt_hash == prompt_hash(prompt(14), 14) and note.lease_deadline > time.time()
    # P's token stopped the request (lease_on_stop false): D may be reading already, so the blocks are leased
    req.status, req.num_computed_tokens = Status.FINISHED_STOPPED, 14
    delay, params = s.request_finished(req, [1, 2, 3, 4])
    assert delay and params is not None and "p1" in s.build_connector_meta(None).send


def test_p_tells_d_when_its_request_ends_before_the_prompt_is_computed():
    s, hid = side(), new_handoff_id()
    req = Req("p1", prompt(14), {"do_remote_decode": True, "pdserve_handoff": hid})
    s.update_state_after_alloc(req, Blocks([1, 2]), 0)
    s.build_connector_meta(output({"p1": 8}, new=[("p1", [1, 2], 0)]))
    req.status, req.num_computed_tokens = Status.FINISHED_ABORTED, 8
    assert s.request_finished(req, [1, 2]) == (False, None)  # not announced: freed at once
    assert s.build_connector_meta(None).ready == {hid: None}


# ---- D's scheduler ----
def test_d_waits_asynchronously_for_the_blocks_it_lacks_with_p_s_ids_unknown():
    s, hid = side(), new_handoff_id()
    book = EngineBook()
    book.learn(P_URL, p_answer())
    req = Req("d1", prompt(14), book.decode_params(P_URL, hid, 14))
    assert s.get_num_new_matched_tokens(req, 4) == (9, True)  # all but the last prompt token, never synchronous
    s.update_state_after_alloc(req, Blocks([5, 6, 7, 8], hashed=1), 9)
    (job,) = s.build_connector_meta(output({})).recv
    assert job.remote.handoff == hid and job.plan.local == (6, 7, 8) and job.plan.remote == ()
    assert job.first_block == 1 and job.expect_hash == prompt_hash(prompt(14), 14)


# ---- P's worker: the rendezvous ----
DEADLINE = time.time() + 3600  # (the module imports vLLM later: tens of seconds on a busy machine)


def note(req_id: str = "p1", first_token: int | None = None) -> ReadyNote:
    return ReadyNote(req_id, (1, 2, 3), 10, prompt_hash(prompt(10), 10), DEADLINE, first_token=first_token)


def test_the_board_answers_a_waiting_d_when_p_announces_and_at_once_after():
    notes: list[tuple[str, int, int]] = []
    board, hid = HandoffBoard("engine-p", lambda *a: notes.append(a)), new_handoff_id()
    got: list[dict[str, Any]] = []
    waiter = threading.Thread(target=lambda: got.append(board.wait(hid, "engine-p", 10.0)))
    waiter.start()
    time.sleep(0.05)
    board.ready(hid, note())
    waiter.join(5)
    assert got and got[0]["ok"] and ReadyNote.from_wire(got[0]) == note()
    assert board.wait(hid, "engine-p", 0.0)["ok"]
    assert notes == []


def test_the_board_refuses_another_engine_a_gone_request_and_a_wait_that_runs_out():
    board, hid = HandoffBoard("engine-p", lambda *a: None), new_handoff_id()
    assert "restarted" in board.wait(hid, "engine-old", 10.0)["why"]
    assert "within" in board.wait(hid, "engine-p", 0.05)["why"]
    board.gone(hid, "aborted")
    assert board.wait(hid, "engine-p", 10.0) == {"ok": False, "why": "aborted"}


def test_a_note_naming_the_hand_off_ends_the_lease_once_p_s_request_id_is_known():
    notes: list[tuple[str, int, int]] = []
    board, hid = HandoffBoard("engine-p", lambda *a: notes.append(a)), new_handoff_id()
    board.note(hid, 0, 1)  # D gave up before P announced
    assert notes == []
    board.ready(hid, note("p7"))
    assert notes == [("p7", 0, 1)]
    board.note(hid, 1, 2)
    assert notes[-1] == ("p7", 1, 2)
    board.expire(time.monotonic() + 10_000)
    assert len(board) == 0


def test_wait_messages_round_trip_and_others_are_not_questions():
    hid = new_handoff_id()
    assert parse_wait(wait_message(hid, "engine-p", 2.5)) == (hid, "engine-p", 2.5)
    assert parse_wait("p1") is None and parse_wait("?wait|p1|e|1") is None
    assert parse_wait(wait_message(hid, "e", 1e9)) == (hid, "e", 600.0)


# ---- D's worker: the rendezvous, then the read ----
class RendezvousEngine:
    """D's transfer engine against P's board: a question is answered by it, a read batch succeeds."""

    def __init__(self, board: HandoffBoard) -> None:
        self.board, self.submitted = board, []

    def submit(self, peer: Any, entries: list, op: str, notify: Any = None, deadline_s: float = 0.0,
               on_frame: Any = None) -> Any:
        from tests.unit.test_vllm_sync_load import FakeHandle

        self.submitted.append((entries, notify))
        from pdserve.vllm.handoff_board import TOKEN_PREFIX

        handle = FakeHandle(False, 0.0)
        wait = parse_wait(notify) if isinstance(notify, str) else None
        token = parse_wait(notify, TOKEN_PREFIX) if isinstance(notify, str) else None
        handle.reply = self.board.wait(*wait) if wait else self.board.wait_token(*token) if token else None
        return handle

    def fetch_segment(self, host: str, port: int) -> Any:
        from types import SimpleNamespace
        return SimpleNamespace(engine_id=HS.engine_id)


def early_job(hid: str, tokens: list[int]) -> Any:
    from pdserve.vllm.messages import RecvJob
    from pdserve.vllm.params import BlockPlan

    book = EngineBook()
    book.learn(P_URL, p_answer())
    remote = RemoteParams.parse(book.decode_params(P_URL, hid, 10), BS)
    return RecvJob("d1", remote, BlockPlan((21, 22), ()), first_block=1, expect_hash=prompt_hash(tokens, 10),
                   continues=True)


@pytest.mark.parametrize("same_prompt", [True, False])
def test_d_reads_p_s_blocks_at_its_positions_once_p_answers_and_checks_the_prompt(same_prompt):
    from tests.unit.test_vllm_sync_load import worker

    board, hid = HandoffBoard(HS.engine_id, lambda *a: None), new_handoff_id()
    board.ready(hid, note("p9"))  # at P's forward; its first token once sampled, while D reads (a second answer)
    w = worker(RendezvousEngine(board), layerwise_kv=False)  # (layer by layer: tests/unit/test_vllm_layerwise.py)
    seen: list[Any] = []
    w._batches = lambda remote, job: (seen.append(job) or board.ready(hid, note("p9", first_token=77))  # sampled
                                      or {0: [("layer", 0, "layer", 0, 3000)]})
    w._run(early_job(hid, prompt(10) if same_prompt else prompt(10, base=5)))
    (job, ok, stats), = w._done
    notes = [n for _, n in w.engine.submitted]
    assert ok is same_prompt
    if same_prompt:  # P's blocks at D's positions 1..2, and the read's notification names P's request
        assert seen[0].plan.remote == (2, 3) and seen[0].remote.request_id == "p9"
        assert notes[-2] == "p9" and "waited_ms" in stats and notes[-1].startswith("?tok|"), (notes, stats)
        assert stats["first_token"] == 77  # P's first token, asked after the read, for D's scheduler
    else:  # never read: D recomputes, and P is told by the hand-off id (its board maps it to P's request)
        assert not seen and "another prompt" in stats["error"] and notes[-1] == hid


# ---- the router's run: P and D at once, D's first token checked against P's ----
P0, D0 = "http://p0", "http://d0"


class PDClient:
    """P answers one token (``t1``) with its kv_transfer_params; D streams one token per event: from the second on
    where it continues after P's (``pdserve_continue``; ``can_continue`` False: its one token marked
    ``pdserve_no_continue``), else its own first token (``d_first``) first."""

    def __init__(self, t1: int = 7, d_first: int = 7, out: int = 4, can_continue: bool = True) -> None:
        self.t1, self.d_first, self.out, self.can_continue = t1, d_first, out, can_continue
        self.calls: list[tuple[str, dict]] = []
        self.closed: list[str] = []

    async def check(self, url: str, timeout_s: float) -> Any:
        from pdserve.router.workers.client import Probe
        return Probe(True, "HTTP 200")

    async def complete(self, url: str, body: dict, wait: Any) -> dict:
        self.calls.append((url, body))
        return {"choices": [{"text": "a", "token_ids": [self.t1], "finish_reason": "length"}],
                "kv_transfer_params": p_answer(remote_request_id="p-req")}

    async def stream(self, url: str, body: dict, wait: Any) -> Any:
        self.calls.append((url, body))
        continues = (body.get("kv_transfer_params") or {}).get("pdserve_continue") is True
        if continues and not self.can_continue:
            try:
                yield {"choices": [{"text": "c", "token_ids": [self.d_first], "finish_reason": "length",
                                    "stop_reason": "pdserve_no_continue"}]}
            finally:
                self.closed.append(url)
            return
        regenerates = len(body["prompt"]) == 40 and not continues  # the prompt alone: D's first token is its own
        tokens = ([self.d_first] if regenerates else []) + [100 + i for i in range(
            body["max_tokens"] - (1 if regenerates or continues else 0))]  # (a continuing D counts P's token)
        try:
            for i, t in enumerate(tokens):
                await asyncio.sleep(0)
                last = i == len(tokens) - 1
                yield {"choices": [{"text": "b", "token_ids": [t], "finish_reason": "length" if last else None}]}
        finally:
            self.closed.append(url)


def pd_run(client: PDClient, rid: str, book: EngineBook, temperature: float = 0.0) -> Any:
    from pdserve.router.api.protocol import parse_completion
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.run.generation import Generation, GenerationOptions
    from pdserve.router.run.timings import Timings
    from tests.unit.test_router_ticket import PROMPT, make

    pl = book_placement.get("pl")
    if pl is None:
        pl = book_placement["pl"] = make("round_robin", members=(("prefill", P0), ("decode", D0)))[0]
    req = parse_completion({"prompt": PROMPT, "max_tokens": client.out, "temperature": temperature})
    req.request_id = rid
    opts = GenerationOptions(prefill_kv_params={"do_remote_decode": True, "lease_on_stop": False}, early=book)
    return Generation(req, PROMPT, client.out, pl, client, RouterMetrics(), Timings(arrive=0.0),  # type: ignore[arg-type]
                      "disaggregated", None, opts)


book_placement: dict[str, Any] = {}


async def run_all(gen: Any) -> list[int]:
    from contextlib import aclosing
    async with aclosing(gen.run()) as deltas:
        return [t async for d in deltas for t in d.token_ids]


def test_the_first_request_to_a_p_is_serial_and_the_next_one_early_with_the_same_output():
    book_placement.clear()
    book, client = EngineBook(), PDClient()
    first = pd_run(client, "r1", book)
    assert asyncio.run(run_all(first)) == [7, 100, 101, 102]
    assert first.t.d_first is not None  # D's first event started the attempt (its timing, a whole one's prefill)
    (_, p1), (_, d1) = client.calls
    assert "pdserve_handoff" not in p1["kv_transfer_params"] and d1["prompt"][-1] == 7  # serial: prompt + [t1]
    client.calls.clear()
    gen = pd_run(client, "r2", book)
    assert asyncio.run(run_all(gen)) == [7, 100, 101, 102]  # D continues after P's token: its stream from token 2
    calls = dict(client.calls)
    hid = calls[P0]["kv_transfer_params"]["pdserve_handoff"]
    assert calls[D0]["kv_transfer_params"]["pdserve_handoff"] == hid and len(calls[D0]["prompt"]) == 40
    assert calls[P0]["kv_transfer_params"]["pdserve_continue"] is calls[D0]["kv_transfer_params"]["pdserve_continue"]
    assert calls[D0]["kv_transfer_params"]["pdserve_continue"] is True  # P announces t1, D continues after it
    assert calls[D0]["max_tokens"] == 4 and gen.ticket is not None and gen.ticket.prefilled  # (D counts t1 in it)


def test_a_d_that_cannot_continue_gives_way_to_the_serial_hand_off():
    """D's read ended without P's first token (P restarted, its answer came too late...): D's one token, marked,
    is not output; D gets the serial request (prompt + [t1], P's lease), and the output is the serial one."""
    book_placement.clear()
    book, client = EngineBook(), PDClient(d_first=9, can_continue=False)
    book.learn(P0, p_answer())
    assert asyncio.run(run_all(pd_run(client, "r1", book))) == [7, 100, 101, 102]
    d_calls = [b for u, b in client.calls if u == D0]
    assert len(d_calls) == 2 and d_calls[0]["kv_transfer_params"]["pdserve_continue"] is True
    assert d_calls[1]["prompt"][-1] == 7 and d_calls[1]["kv_transfer_params"]["remote_request_id"] == "p-req"
    assert "pdserve_continue" not in d_calls[1]["kv_transfer_params"] and d_calls[1]["max_tokens"] == 3
    assert client.closed.count(D0) == 2


def test_a_d_whose_first_token_differs_gives_way_to_the_serial_hand_off():
    """Without continuation (router --early-continue never) D regenerates P's token and the router compares."""
    book_placement.clear()
    book, client = EngineBook("never"), PDClient(d_first=9)
    book.learn(P0, p_answer())
    assert asyncio.run(run_all(pd_run(client, "r1", book))) == [7, 100, 101, 102]
    d_calls = [b for u, b in client.calls if u == D0]
    assert len(d_calls) == 2 and "pdserve_handoff" in d_calls[0]["kv_transfer_params"]
    assert d_calls[1]["prompt"][-1] == 7 and d_calls[1]["kv_transfer_params"]["remote_request_id"] == "p-req"
    assert client.closed.count(D0) == 2  # the early stream was closed (vLLM aborts it)


def test_unseeded_random_sampling_stays_serial_unless_d_continues_after_p_s_token():
    """D's regenerated token would be a sample of its own; continuing after P's, D is the serial D."""
    for continues in (False, True):
        book_placement.clear()
        book, client = EngineBook("always" if continues else "never"), PDClient()
        book.learn(P0, p_answer())
        assert asyncio.run(run_all(pd_run(client, "r1", book, temperature=0.8))) == [7, 100, 101, 102]
        early = ["pdserve_handoff" in b.get("kv_transfer_params", {}) for _, b in client.calls]
        assert early == ([True, True] if continues else [False, False])
