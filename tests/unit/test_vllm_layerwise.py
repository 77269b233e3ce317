"""Issue 37 item 2, layer-wise KV of an early hand-off: P's board answers D's layer question as each layer is
marked written, per-layer checksums add up to the block's, and over real transfer engines (two WorkerSides in one
process, a fake "forward" driven by hand) D reads each layer while P's forward has not ended, verifies it, and
fails the read (recompute) on a flipped byte or a P that never finishes."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdserve.router.run.early_dispatch import new_handoff_id
from pdserve.vllm.handoff_board import HandoffBoard, layers_message, parse_layers
from pdserve.vllm.integrity import BlockSums
from pdserve.vllm.layerwise import LayerMarks
from pdserve.vllm.messages import PdserveMeta, ReadyNote, RecvJob
from pdserve.vllm.params import BlockPlan, ConnectorConfig, LayerGeometry, RemoteParams, prompt_hash

from .gate_event import GateEvent

SECRET = "0123456789abcdef-layerwise"
BS, NB, HEADS, D = 16, 6, 2, 8
LAYERS = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.10.attn")  # registered in name order


def note(req_id: str = "p1", blocks: tuple[int, ...] = (3, 4)) -> ReadyNote:
    return ReadyNote(req_id, blocks, 2 * BS, prompt_hash(list(range(2 * BS)), 2 * BS), time.time() + 60)


# ---- the board ----
def test_layer_questions_round_trip_and_malformed_ones_are_not_questions():
    hid = new_handoff_id()
    q = parse_layers(layers_message(hid, "e", 2.5, 0b101, 1, 3))
    assert q is not None and (q.handoff, q.engine_id, q.wait_s, q.have, q.first, q.end) == (hid, "e", 2.5, 5, 1, 3)
    assert parse_layers(layers_message(hid, "e", 1e9, 0, 0, 1)).wait_s == 600.0  # type: ignore[union-attr]
    assert parse_layers("?layers|p1|e|1|0|0|1") is None  # not a hand-off id
    assert parse_layers(f"?layers|{hid}|e|1|zz|0|1") is None and parse_layers(f"?layers|{hid}|e|1|0|2|1") is None
    assert parse_layers(f"?wait|{hid}|e|1") is None


def test_the_board_answers_each_new_layer_then_the_forward_s_end():
    board, hid = HandoffBoard("engine-p", lambda *a: None), new_handoff_id()

    def ask(have: int, wait_s: float = 10.0) -> dict[str, Any]:
        q = parse_layers(layers_message(hid, "engine-p", wait_s, have, 0, 2))
        assert q is not None
        return board.wait_layers(q)

    assert "within" in ask(0, 0.05)["why"]  # nothing known yet
    board.begin(hid, note())
    assert "within" in ask(0, 0.05)["why"]  # the forward started, no layer written yet
    got: list[dict[str, Any]] = []
    waiter = threading.Thread(target=lambda: got.append(ask(0)))
    waiter.start()
    time.sleep(0.05)
    board.layer([hid], 1)
    waiter.join(5)
    assert got[0]["ok"] and got[0]["layers"] == "2" and got[0]["done"] is False and got[0]["req"] == "p1"
    assert "within" in ask(0b10, 0.05)["why"]  # D has layer 1: only a new one answers
    board.layer([hid], 0)
    assert ask(0b10)["layers"] == "3"
    board.ready(hid, note())
    assert ask(0b11)["done"] is True and ask(0b11)["ok"]  # the forward ended: every layer is final
    assert "restarted" in board.wait_layers(parse_layers(layers_message(hid, "old", 1, 0, 0, 2)))["why"]  # type: ignore[arg-type]


def test_a_question_that_needs_several_layers_is_answered_once_that_many_are_new_or_the_forward_ends():
    hid = new_handoff_id()
    q = parse_layers(layers_message(hid, "e", 1.0, 0b1, 0, 2, need=2))
    assert q is not None and q.need == 2
    assert parse_layers(f"?layers|{hid}|e|1|0|0|2").need == 1  # type: ignore[union-attr]  # without it: one
    assert parse_layers(f"?layers|{hid}|e|1|0|0|2|0") is None and parse_layers(f"?layers|{hid}|e|1|0|0|2|x") is None
    board = HandoffBoard("engine-p", lambda *a: None)
    board.begin(hid, note())

    def ask(have: int, need: int, wait_s: float = 10.0) -> dict[str, Any]:
        question = parse_layers(layers_message(hid, "engine-p", wait_s, have, 0, 2, need))
        assert question is not None
        return board.wait_layers(question)

    board.layer([hid], 0)
    assert "within" in ask(0, 2, 0.05)["why"]  # one new layer of the two asked for
    assert ask(0, 1)["layers"] == "1"
    board.layer([hid], 1)
    assert ask(0, 2)["layers"] == "3"
    board.ready(hid, note())
    assert ask(0b11, 3)["done"] is True  # the forward's end answers whatever is new


class _CountingCond:
    """An entry's condition that counts its wake-ups."""

    def __init__(self, cond: threading.Condition) -> None:
        self.cond, self.wakes = cond, 0

    def wait(self, timeout: float | None = None) -> bool:
        return self.cond.wait(timeout)

    def notify_all(self) -> None:
        self.wakes += 1
        self.cond.notify_all()


def test_a_written_layer_wakes_only_the_questions_it_answers():
    board, h1, h2 = HandoffBoard("engine-p", lambda *a: None), new_handoff_id(), new_handoff_id()
    board.begin(h1, note())
    board.begin(h2, note("p2"))
    conds = {h: _CountingCond(board._entries[h].cond) for h in (h1, h2)}
    for h, cond in conds.items():
        board._entries[h].cond = cond  # type: ignore[assignment]
    got: dict[str, dict[str, Any]] = {}
    q1 = parse_layers(layers_message(h1, "engine-p", 10.0, 0, 0, 2, need=2))
    assert q1 is not None
    threads = [threading.Thread(target=lambda: got.__setitem__(h1, board.wait_layers(q1))),
               threading.Thread(target=lambda: got.__setitem__(h2, board.wait(h2, "engine-p", 10.0)))]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 5
    while not board._entries[h1].waits and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # h2's whole-prompt question waits too
    board.layer([h1, h2], 0)
    assert (conds[h1].wakes, conds[h2].wakes) == (0, 0)  # h1 asked for two new layers; h2 for the whole prompt
    board.layer([h1, h2], 1)
    threads[0].join(5)
    assert (conds[h1].wakes, conds[h2].wakes) == (1, 0) and got[h1]["layers"] == "3"
    assert board._entries[h1].waits == []
    board.ready(h2, note("p2"))
    threads[1].join(5)
    assert conds[h2].wakes == 1 and got[h2]["ok"] and got[h2]["req"] == "p2"


def test_a_waiter_of_an_expired_entry_looks_again():
    board, hid = HandoffBoard("engine-p", lambda *a: None, ttl_s=0.0), new_handoff_id()
    got: list[dict[str, Any]] = []
    waiter = threading.Thread(target=lambda: got.append(board.wait(hid, "engine-p", 10.0)))
    waiter.start()
    time.sleep(0.05)
    board.expire(time.monotonic() + 1)  # the waiter's entry leaves; the waiter waits on a fresh one
    time.sleep(0.05)
    board.ready(hid, note())
    waiter.join(5)
    assert got and got[0]["ok"]


def test_a_layer_read_asks_for_enough_layers_to_fill_a_batch():
    from pdserve.vllm.layerwise import LayerPull

    layers = [LayerGeometry(name, 4096, 4096) for name in LAYERS]  # 4 KiB a block and layer

    def need(min_bytes: int, blocks: int, have: int = 0) -> int:
        pull = LayerPull(None, None, "e", layers, BlockSums([], {}), 0, False, 0, lambda job, n: job, min_bytes)
        return pull.need(blocks, have)

    assert need(0, 4) == 1  # off: a batch as soon as any layer is new
    assert need(4096, 4) == 1  # one layer of 4 blocks is 16 KiB
    assert need(32 << 10, 4) == 2 and need(40 << 10, 4) == 3
    assert need(1 << 20, 4) == 3 and need(1 << 20, 4, have=0b001) == 2  # never more than the layers missing
    assert need(1 << 20, 4, have=0b111) == 1


def test_the_board_tells_a_layer_waiter_when_p_s_request_is_gone():
    board, hid = HandoffBoard("engine-p", lambda *a: None), new_handoff_id()
    q = parse_layers(layers_message(hid, "engine-p", 10.0, 0, 0, 2))
    assert q is not None
    board.gone(hid, "aborted")
    assert board.wait_layers(q) == {"ok": False, "why": "aborted"}


def test_layer_marks_complete_a_region_once_every_layer_sharing_it_is_saved():
    marks = LayerMarks()
    for name, region in (("a", 0), ("b", 1), ("b2", 1)):  # b and b2 share one tensor (cross-layer KV sharing)
        marks.add(name, region)
    assert marks.saved("a") is None  # nothing live: no forward completes a hand-off
    marks.begin(["h1"])
    assert marks.saved("a") == 0 and marks.saved("b") is None and marks.saved("b2") == 1
    assert marks.saved("unknown") is None
    marks.end()
    assert marks.saved("a") is None and marks.live == []


def test_per_layer_sums_add_up_to_the_block_s_and_see_a_flip_in_their_layer_only():
    mems = {f"l{i}": torch.randint(0, 255, (NB * 64,), dtype=torch.uint8).numpy() for i in range(3)}
    layers = [LayerGeometry(f"l{i}", 64, 64, ((0, 32), (32, 32))) for i in range(3)]
    sums = BlockSums(layers, mems)
    whole = sums.sums([1, 2])
    parts = [sums.region_sums([1, 2], [i]) for i in range(3)]
    assert [sum(p[j] for p in parts) % (1 << 64) for j in range(2)] == whole
    assert sums.region_sums([1, 2], [0, 2]) == [(parts[0][j] + parts[2][j]) % (1 << 64) for j in range(2)]
    wsum = sums.region_sums([1, 2], [0, 1, 2], "wsum32")
    assert wsum == sums.sums([1, 2], "wsum32")
    sums.flip_byte(1, 3, unit=2)  # unit 2: layer 1's first run
    assert sums.region_sums([1], [0]) == [parts[0][0]] and sums.region_sums([1], [2]) == [parts[2][0]]
    assert sums.region_sums([1], [1]) != [parts[1][0]]


# ---- P -> D over real transfer engines ----
def _side(fill: bool, **extra: Any) -> Any:
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from pdserve.vllm.worker import WorkerSide

    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS,
                                                       get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC),
                          model_config=None, parallel_config=None)
    # layer_batch_bytes 0: these layers are a few KiB, and the tests follow each one (batching: its own test)
    conf = ConnectorConfig.from_extra({"secret": SECRET, "allow_test_faults": True, "handoff_wait_s": 5.0,
                                       "layer_batch_bytes": 0, **extra})
    w = WorkerSide(cfg, conf)  # type: ignore[arg-type]
    w.tp, w.rank, w.kv_heads = 1, 0, HEADS
    caches = {}
    for i, name in enumerate(LAYERS):
        cache = torch.zeros((NB, HEADS, BS, 2 * D), dtype=torch.float32)
        if fill:
            for b in range(NB):
                cache[b] = torch.arange(HEADS * BS * 2 * D, dtype=torch.float32).view(HEADS, BS, 2 * D) + 100 * b + i
        caches[name] = cache
    w.register_kv_caches(caches)
    return w


@pytest.fixture
def pair():
    made: list[Any] = []

    def make(p_extra: dict | None = None, d_extra: dict | None = None) -> tuple[Any, Any]:
        made.extend([_side(True, **(p_extra or {})), _side(False, **(d_extra or {}))])
        return made[-2], made[-1]

    yield make
    for w in made:
        w.close()


def _early(p: Any, hid: str, fault: str = "") -> RecvJob:
    h = p.handshake()
    n = note()
    remote = RemoteParams(h.engine_id, h.host, h.port, (), n.num_tokens, hid, h.layout, "", 0.0, fault,
                          handoff=hid)
    return RecvJob("dreq", remote, BlockPlan((0, 1), ()), expect_hash=n.prompt_hash)


def _landed(d: Any, p: Any, layer: str) -> bool:
    return torch.equal(d._tensors[layer][:2], p._tensors[layer][3:5])


def _wait(cond: Any, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def _forward(p: Any, d: Any, hid: str, fault: str = "") -> tuple[threading.Thread, Any]:
    """P's forward that completes the prompt starts; D's read runs in a thread meanwhile."""
    meta = PdserveMeta(ready={hid: note()}, seal_now={"p1": (3, 4)})
    p.start(meta)
    reader = threading.Thread(target=d._run, args=(_early(p, hid, fault),), daemon=True)
    reader.start()
    return reader, meta


@pytest.mark.parametrize("backend", ["auto", "tcp", "local", "nixl", "mooncake"])  # every transport of the engine
def test_d_reads_and_verifies_each_layer_before_p_s_forward_ends(pair, backend):
    p, d = pair({"backend": backend}, {"backend": backend})
    hid = new_handoff_id()
    reader, meta = _forward(p, d, hid)
    time.sleep(0.1)
    assert not any(_landed(d, p, name) for name in LAYERS)  # nothing written yet: nothing moves
    p.layer_saved(LAYERS[0], meta)
    _wait(lambda: _landed(d, p, LAYERS[0]))  # layer 0 landed while the forward goes on
    assert not _landed(d, p, LAYERS[1])
    p.layer_saved(LAYERS[1], meta)
    _wait(lambda: _landed(d, p, LAYERS[1]))
    p.layer_saved(LAYERS[2], meta)
    reader.join(10)
    assert not reader.is_alive()  # D's load is over, and P's forward has not ended yet
    res = d.results()
    assert res.finished_recving == {"dreq"} and not res.failed_recving
    stats = d.take_worker_meta().reads["dreq"]
    assert stats["ok"] and stats["layerwise"] == 3 and stats["layers_early"] == 2, stats
    assert stats["bytes"] == 2 * 3 * HEADS * BS * 2 * D * 4 and stats["verified"] == 2
    counters = d.take_stats().data
    assert counters["layerwise_reads"] == 1 and counters["layers_early"] == 2
    p.after_forward(meta)
    assert all(_landed(d, p, name) for name in LAYERS)
    assert p.take_stats().data["layer_answer_seconds"] > 0  # P's own CPU for the answers (their checksums)


def test_on_a_device_p_tells_d_of_a_layer_and_of_the_forward_s_end_once_their_kernels_ran(pair, monkeypatch):
    """P's KV in CUDA memory (here: host memory taken for it, with stand-in events): save_kv_layer and
    wait_for_save come when the kernels are queued, so the board hears of each layer, and of the forward's end, only
    once the event recorded then completed (pdserve.vllm.fence); D reads nothing before."""
    import pdserve.vllm.worker as worker_module

    p, d = pair()
    p._cuda = True
    events: list[GateEvent] = []

    def record(cuda: bool) -> GateEvent:
        assert cuda
        events.append(GateEvent())
        return events[-1]

    monkeypatch.setattr(worker_module, "record_event", record)
    hid = new_handoff_id()
    reader, meta = _forward(p, d, hid)
    p.layer_saved(LAYERS[0], meta)
    p.layer_saved(LAYERS[1], meta)
    time.sleep(0.2)
    assert len(events) == 2 and not any(_landed(d, p, name) for name in LAYERS)  # queued, not run: nothing moves
    events[0].done()
    _wait(lambda: _landed(d, p, LAYERS[0]))
    time.sleep(0.1)
    assert not _landed(d, p, LAYERS[1])
    events[1].done()
    _wait(lambda: _landed(d, p, LAYERS[1]))
    p.layer_saved(LAYERS[2], meta)
    p.after_forward(meta)  # the forward's end: one event for the seal and the announcement
    time.sleep(0.2)
    assert reader.is_alive() and not _landed(d, p, LAYERS[2])
    for event in events[2:]:
        event.done()
    reader.join(10)
    assert not reader.is_alive() and all(_landed(d, p, name) for name in LAYERS)
    res = d.results()
    assert res.finished_recving == {"dreq"} and not res.failed_recving
    assert d.take_worker_meta().reads["dreq"]["ok"]


def test_a_flipped_byte_in_one_layer_fails_the_read(pair):
    p, d = pair()
    hid = new_handoff_id()
    reader, meta = _forward(p, d, hid, fault="flip")
    for name in LAYERS:
        p.layer_saved(name, meta)
    p.after_forward(meta)
    reader.join(10)
    res = d.results()
    assert res.failed_recving == {"dreq"}, res
    stats = d.take_worker_meta().reads["dreq"]
    assert "checksum" in stats["error"] and d.take_invalid_blocks() == {0, 1}


def test_layerwise_off_on_d_reads_the_whole_prompt_after_the_forward(pair):
    p, d = pair(d_extra={"layerwise_kv": False})
    hid = new_handoff_id()
    reader, meta = _forward(p, d, hid)
    for name in LAYERS:
        p.layer_saved(name, meta)
    time.sleep(0.2)
    assert not any(_landed(d, p, name) for name in LAYERS)  # the whole-request path waits for the forward's end
    p.after_forward(meta)
    reader.join(10)
    stats = d.take_worker_meta().reads["dreq"] if d.results().finished_recving else {}
    assert stats.get("ok") and "layerwise" not in stats and all(_landed(d, p, name) for name in LAYERS)


@pytest.mark.parametrize("how", ["stops", "dies"])
def test_p_that_stops_or_dies_mid_layers_ends_d_s_wait_and_the_read_fails(pair, how):
    p, d = pair(d_extra={"handoff_wait_s": 0.5 if how == "stops" else 30.0})
    hid = new_handoff_id()
    reader, meta = _forward(p, d, hid)
    p.layer_saved(LAYERS[0], meta)
    _wait(lambda: _landed(d, p, LAYERS[0]))
    t0 = time.monotonic()
    if how == "dies":
        p.engine.close()  # its connections drop: D's question ends at once, not after its 30 s wait
    reader.join(10)  # "stops": P never writes the other layers, D's bounded wait ends
    assert not reader.is_alive() and time.monotonic() - t0 < 5.0
    res = d.results()
    assert res.failed_recving == {"dreq"} and d.take_invalid_blocks() == {0, 1}
    error = d.take_worker_meta().reads["dreq"]["error"]
    # "stops": D's bounded wait ended, told by P ("not ready within") or, when P's answer comes after D's own deadline
    # on a loaded machine, by D ("announced 1 of 3 layers ... within")
    stopped = "not ready within" in error or "announced 1 of 3 layers" in error
    assert stopped if how == "stops" else ("TransferError" in error), error


def test_only_an_early_read_of_the_same_tp_and_layout_goes_layer_by_layer(pair):
    p, d = pair()
    remote = _early(p, new_handoff_id()).remote
    assert d._layerwise(remote)
    d.tp = 2  # P's TP unlike ours: the read reshards heads, the whole-request path
    assert not d._layerwise(remote)
    d.tp = 1
    assert not d._layerwise(RemoteParams(**{**remote.__dict__, "layout": "float32/bs16/L1/other"}))
    off = _side(False, layerwise_kv=False)
    try:
        assert not off._layerwise(remote)
    finally:
        off.close()
