"""Issue 27, KV integrity: block checksums (xxh3 on host memory, the batched wsum32 reduction designed for device
memory, run here on CPU tensors in vLLM's GPU layouts), P's sealed leases answered to D's notification, D's
verification over real transfer engines (in one process), the fault cases (a byte flipped in transit, a late write
into P's block), the compatibility fingerprint and the scheduler's refusal by field."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdserve.transfer.checksum import WSUM, XXH3, XXH3U, sum_u64, to_u64, wsum_rows, xxh3_spans, xxh3_unit
from pdserve.vllm.fingerprint import differences, digest, model_hash, parse
from pdserve.vllm.integrity import ArrivalHasher, BlockSums, ReadVerifier, SealTable, check_read, mismatched
from pdserve.vllm.kvmemory import byte_region
from pdserve.vllm.messages import PdserveHandshake, PdserveMeta, RecvJob
from pdserve.vllm.params import BlockPlan, ConnectorConfig, LayerGeometry, RemoteParams, prompt_hash

SECRET = "0123456789abcdef-integrity"
BS, NB, HEADS, D = 16, 6, 2, 8


# ------------------------------------------------------------------------------------------ checksums
def _reference_wsum(data: bytes) -> int:
    words = np.frombuffer(data, dtype="<i4").astype(np.int64)
    weights = np.arange(len(words), dtype=np.int64) * 2 + 1
    return to_u64(int(sum(int(w) * int(x) for w, x in zip(weights, words))))


def test_xxh3_spans_equals_the_hash_of_the_concatenation():
    import xxhash

    a = np.arange(1000, dtype=np.uint8)
    assert xxh3_spans([a[:300], memoryview(a)[300:700], a[700:]]) == xxhash.xxh3_64_intdigest(a.tobytes())


def test_wsum_rows_matches_the_definition_and_adds_up_over_pieces():
    rng = np.random.default_rng(1)
    rows = torch.from_numpy(rng.integers(0, 256, (3, 64), dtype=np.uint8))
    whole = [to_u64(v) for v in wsum_rows(rows).tolist()]
    assert whole == [_reference_wsum(r.numpy().tobytes()) for r in rows]
    parts = wsum_rows(rows[:, :24]) + wsum_rows(rows[:, 24:], first_word=6)
    assert [to_u64(v) for v in parts.tolist()] == whole
    with pytest.raises(ValueError):
        wsum_rows(rows[:, :6])


def _numpy_wsum(data: bytes) -> int:
    """wsum32 by another arithmetic: numpy unsigned 64-bit products and sum, which wrap mod 2**64 by definition."""
    words = np.frombuffer(data, dtype="<i4").astype(np.int64).astype(np.uint64)
    weights = np.arange(len(words), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    with np.errstate(over="ignore"):
        return int((words * weights).sum(dtype=np.uint64))


def test_wsum_rows_wraps_like_the_exact_sum_mod_2_64():
    """Rows whose int64 sum overflows (1 MiB of words near +-2**31): torch's wrapping int64 sum equals the exact
    integer sum mod 2**64 (Python integers) and numpy's unsigned wrapping sum."""
    rng = np.random.default_rng(5)
    words = rng.choice(np.array([2**31 - 1, -2**31, -1, 2**31 - 7], dtype=np.int32), size=(2, 1 << 18))
    rows = torch.from_numpy(words.view(np.uint8).reshape(2, -1).copy())
    got = [to_u64(v) for v in wsum_rows(rows).tolist()]
    for row, value in zip(words, got):
        exact = sum(int(w) * (2 * j + 1) for j, w in enumerate(row.tolist())) % (1 << 64)
        assert abs(sum(int(w) * (2 * j + 1) for j, w in enumerate(row.tolist()))) > 1 << 63  # it did overflow
        assert value == exact == _numpy_wsum(row.tobytes())


def test_block_sums_wsum_equals_the_definition_over_a_blocks_units():
    """BlockSums' batched wsum32 over two layers of K and V planes (vLLM's FlashAttention layout [2, B, N, H, D] on
    CPU tensors) equals wsum32 of the block's units laid end to end, computed byte by byte in numpy."""
    caches = {f"l{i}": torch.randn((2, NB, BS, HEADS, D), dtype=torch.float16) for i in range(2)}
    layers = [LayerGeometry(name, g.block_stride, g.block_bytes, g.runs) for name, c in caches.items()
              for g in _layers_flash(c)]
    flat = {name: c.view(-1).view(torch.uint8) for name, c in caches.items()}
    sums = BlockSums(layers, flat)
    assert sums.alg == WSUM
    for block in (0, 3, NB - 1):
        joined = b"".join(flat[name][off:off + n].numpy().tobytes() for name, off, n in sums.units(block))
        assert sums.sums([block]) == [_numpy_wsum(joined)] == [_reference_wsum(joined)]


def _layers_flash(cache: torch.Tensor) -> list[LayerGeometry]:
    """FlashAttention's [2, B, N, H, D]: a block is two runs, K's and V's planes apart."""
    elem = cache.element_size()
    stride = cache.stride(1) * elem
    plane = cache.stride(0) * elem
    return [LayerGeometry("l0", stride, 2 * stride, ((0, stride), (plane, stride)))]


@pytest.mark.parametrize("layout", ["nhd", "flash"])
def test_block_sums_host_and_device_algorithms_see_every_byte(layout):
    """The same blocks hashed by xxh3u (host path) and wsum32 (the device path, here on a CPU tensor given as a
    tensor, as a CUDA region would be): each block's sum changes when one byte of it flips, and no other's does."""
    shape = (NB, BS, HEADS, 2 * D) if layout == "nhd" else (2, NB, BS, HEADS, D)
    cache = torch.randn(shape, dtype=torch.float16)
    nbytes = cache.numel() * cache.element_size()
    if layout == "nhd":
        layers = [LayerGeometry("l0", cache.stride(0) * 2, cache.stride(0) * 2)]
    else:
        layers = _layers_flash(cache)
    host = BlockSums(layers, {"l0": byte_region(cache, nbytes)})
    dev = BlockSums(layers, {"l0": cache.view(-1).view(torch.uint8)})
    assert host.alg == XXH3U and dev.alg == WSUM
    blocks = [0, 2, 5]
    for sums in (host, dev):
        before = sums.sums(blocks)
        assert len(set(before)) == 3
        assert sums.sums(blocks, WSUM) == dev.sums(blocks)  # the verifier computes the producer's algorithm
        assert sums.sums(blocks, XXH3) == host.sums(blocks, XXH3)  # pool objects sealed with xxh3 still verify
        sums.flip_byte(2, at=7)
        after = sums.sums(blocks)
        assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
        sums.flip_byte(2, at=7)  # back
        assert sums.sums(blocks) == before
    if layout == "flash":  # the V plane counts: a flip there changes the block's sum
        v_off = layers[0].block_runs[1][0] + 2 * layers[0].block_stride + 3
        before = host.sums([2])
        host.memory["l0"][v_off] ^= 1
        assert host.sums([2]) != before


def _two_layers() -> BlockSums:
    """Two layers of NB blocks, each block two runs (K and V planes apart), over numpy memory."""
    rng = np.random.default_rng(7)
    stride, run = 256, 128
    plane = NB * stride
    layers = [LayerGeometry(f"l{i}", stride, 2 * run, ((0, run), (plane, run))) for i in range(2)]
    return BlockSums(layers, {g.name: rng.integers(0, 256, 2 * plane, dtype=np.uint8) for g in layers})


def test_xxh3u_is_the_seeded_sum_of_a_blocks_units():
    sums = _two_layers()
    want = sum_u64(xxh3_unit(sums.memory[name][off:off + n], k) for k, (name, off, n) in enumerate(sums.units(3)))
    assert sums.sums([3]) == [want] and len(sums.units(3)) == 4
    a, b = sums.units(3)[:2]  # two units swapped in place: the seeds tie each hash to its place
    mem = sums.memory["l0"]
    mem[a[1]:a[1] + 128], mem[b[1]:b[1] + 128] = mem[b[1]:b[1] + 128].copy(), mem[a[1]:a[1] + 128].copy()
    assert sums.sums([3]) != [want]


@pytest.mark.parametrize("split", [0, 1, 5])
def test_arrival_hasher_equals_the_block_sums_whatever_frames_land_in_whatever_order(split):
    sums = _two_layers()
    blocks = [4, 1, 2]
    pieces = []  # every unit's bytes, cut in ``split`` places, as (region, offset, ..., length) frame entries
    rng = np.random.default_rng(split)
    for b in blocks:
        for name, off, n in sums.units(b):
            cuts = sorted({0, n, *rng.integers(1, n, split).tolist()})
            pieces += [(name, off + lo, name, 0, hi - lo) for lo, hi in zip(cuts, cuts[1:])]
    rng.shuffle(pieces)
    tap = ArrivalHasher(sums, blocks)
    for i in range(0, len(pieces), 3):
        tap.frame(pieces[i:i + 3])
    assert tap.result() == sums.sums(blocks)
    partial = ArrivalHasher(sums, blocks)  # a data path without the hook: hashed at the end
    partial.frame(pieces[:2])
    assert partial.result() == sums.sums(blocks)
    foreign = ArrivalHasher(sums, blocks)  # bytes of other blocks or regions are not this read's
    foreign.frame([("l0", 0, "l0", 0, 256), ("other", 0, "other", 0, 64)] + pieces)
    assert foreign.result() == sums.sums(blocks)
    before = sums.sums(blocks)
    flipped = ArrivalHasher(sums, blocks, [(0, 0, 0, 0xFF)])  # test fault: corrupted as it lands
    flipped.frame(pieces)
    got = flipped.result()
    assert got[0] != before[0] and got[1:] == before[1:] and got == sums.sums(blocks)
    before = got
    scattered = ArrivalHasher(sums, blocks, [(1, 3, 5, 0x10), (2, 1, 127, 0x01)])  # other blocks, layers, offsets
    scattered.frame(pieces)
    got = scattered.result()
    assert got[0] == before[0] and got[1] != before[1] and got[2] != before[2] and got == sums.sums(blocks)


def test_check_read_uses_what_landed_when_p_used_xxh3u():
    from pdserve.transfer import TransferError

    sums, verifier = _two_layers(), ReadVerifier()
    good = sums.sums([1, 2])
    reply = {"alg": XXH3U, "fp": 9, "b": [7, 8], "c": good}
    stats: dict = {}
    assert verifier.tap(sums, [1, 2]) is None  # a small read: hashed after it landed
    verifier.min_bytes = 0
    tap = verifier.tap(sums, [1, 2])
    assert tap is not None
    verifier.verify(sums, 9, reply, [1, 2], [7, 8], tap, "request r", stats)
    assert stats == {"verified": 2, "streamed": True}
    with pytest.raises(TransferError, match="differ"):
        verifier.verify(sums, 9, reply, [1, 2], [7, 8], verifier.tap(sums, [1, 2], [(0, 0, 0, 0xFF)]), "r", stats)
    assert stats["checksum_failed"]
    dev = BlockSums(sums.layers, {n: torch.from_numpy(m) for n, m in sums.memory.items()})
    assert dev.alg == WSUM and verifier.tap(dev, [1, 2]) is None  # device memory: hashed after the read


def test_mismatched_pairs_local_with_remote_blocks():
    assert mismatched({10: 1, 11: 2}, [0, 1], [10, 11], [1, 2]) == []
    assert mismatched({10: 1, 11: 2}, [0, 1], [10, 11], [1, 3]) == [1]
    assert mismatched({10: 1}, [0, 1], [10, 11], [1, 2]) == [1]  # P did not seal block 11


# ------------------------------------------------------------------------------------------ seal table
def test_seal_table_answers_waits_for_a_late_lease_and_forgets_ended_ones():
    table = SealTable(wait_s=0.5)
    table.seal("r", (3, 4), lambda b: [x * 10 for x in b])
    assert table.reply("r", XXH3, 7) == {"alg": XXH3, "fp": 7, "b": [3, 4], "c": [30, 40]}
    t0 = time.monotonic()
    assert "missing" in table.reply("other", XXH3, 7) and time.monotonic() - t0 >= 0.4
    import threading
    threading.Timer(0.1, lambda: table.seal("late", (1,), lambda b: [5])).start()
    assert table.reply("late", XXH3, 7)["c"] == [5]  # the lease arrived while D's notification waited
    table.drop(["r", "late"])
    assert len(table) == 0 and "missing" in SealTable(wait_s=0.0).reply("r", XXH3, 7)
    t0 = time.monotonic()
    assert table.reply("r", XXH3, 7)["missing"] == "the lease ended" and time.monotonic() - t0 < 0.1  # no wait
    assert table.reply("r", XXH3, 7, (1, 2), lambda b: [0, 0])["missing"] == "the lease ended"
    # not heard of yet: the blocks D read are checksummed now, and marked so
    assert table.reply("new", XXH3, 7, (1, 2), lambda b: [b[0] * 3, b[1] * 3]) == \
        {"alg": XXH3, "fp": 7, "b": [1, 2], "c": [3, 6], "unsealed": True}
    table.close()


def test_check_read_names_each_problem():
    cache = torch.arange(NB * 64, dtype=torch.int32).to(torch.uint8)
    sums = BlockSums([LayerGeometry("l0", 64, 64)], {"l0": cache.numpy()})
    good = sums.sums([1, 2])
    assert check_read(sums, 9, {"alg": XXH3, "fp": 9, "b": [7, 8], "c": good}, [1, 2], [7, 8]) == ("", 2)
    assert "differ" in check_read(sums, 9, {"alg": XXH3, "fp": 9, "b": [7, 8], "c": good[::-1]}, [1, 2], [7, 8])[0]
    assert "fingerprint" in check_read(sums, 9, {"alg": XXH3, "fp": 8, "b": [7, 8], "c": good}, [1, 2], [7, 8])[0]
    assert "no lease" in check_read(sums, 9, {"fp": 9, "missing": "no lease"}, [1, 2], [7, 8])[0]
    assert "no checksums" in check_read(sums, 9, None, [1, 2], [7, 8])[0]


# ------------------------------------------------------------------------------------------ P -> D, real engines
def _side(fill: bool, **extra):
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from pdserve.vllm.worker import WorkerSide

    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS,
                                                       get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC),
                          model_config=None, parallel_config=None)
    conf = ConnectorConfig.from_extra({"secret": SECRET, "allow_test_faults": True, **extra})
    w = WorkerSide(cfg, conf)  # type: ignore[arg-type]
    w.tp, w.rank, w.kv_heads = 1, 0, HEADS
    cache = torch.zeros((NB, HEADS, BS, 2 * D), dtype=torch.float32)
    if fill:
        for b in range(NB):
            cache[b] = torch.arange(HEADS * BS * 2 * D, dtype=torch.float32).view(HEADS, BS, 2 * D) + 100 * b
    w.register_kv_caches({"layer.0": cache})
    return w


@pytest.fixture
def pair():
    made = []

    def make(p_extra=None, d_extra=None):
        made.extend([_side(True, **(p_extra or {})), _side(False, **(d_extra or {}))])
        return made[-2], made[-1]

    yield make
    for w in made:
        w.close()


def _lease(p, req: str, fault: str = "", seal: bool = True) -> RemoteParams:
    deadline = time.time() + 30
    p.start(PdserveMeta(send={req: deadline}, seal={req: (3, 4)} if seal else {},
                        faults={req: fault} if fault else {}))
    h = p.handshake()
    return RemoteParams(h.engine_id, h.host, h.port, (3, 4), 2 * BS, req, h.layout, "", deadline, "",
                        fingerprint=h.fingerprint)


def _read(d, remote: RemoteParams, fault: str = ""):
    if fault:
        remote = RemoteParams(**{**remote.__dict__, "test_fault": fault})
    d._run(RecvJob("dreq", remote, BlockPlan((0, 1), (3, 4))))
    res = d.results()
    return res, d.take_worker_meta().reads["dreq"], d.take_stats()


@pytest.mark.parametrize("streamed", [False, True])
def test_p_seals_its_lease_and_d_verifies_the_read(pair, streamed):
    p, d = pair()
    d.verifier.min_bytes = 0 if streamed else 1 << 40
    res, stats, _ = _read(d, _lease(p, "req"))
    assert res.finished_recving == {"dreq"} and not res.failed_recving, stats
    assert stats["ok"] and stats["verified"] == 2 and stats["streamed"] == streamed
    assert torch.equal(d._tensors["layer.0"][:2], p._tensors["layer.0"][3:5])


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("fault", ["flip", "late"])
def test_corruption_in_transit_or_a_late_write_fails_the_read(pair, fault, streamed):
    p, d = pair()
    d.verifier.min_bytes = 0 if streamed else 1 << 40  # hashed as the frames land, or after the read
    remote = _lease(p, "req", fault="late" if fault == "late" else "")
    if fault == "late":
        time.sleep(0.2)  # P sealed, then wrote into the block; D reads afterwards
    res, stats, counters = _read(d, remote, fault="flip" if fault == "flip" else "")
    assert res.failed_recving == {"dreq"} and not stats["ok"] and stats["checksum_failed"]
    assert "differ from P's checksums" in stats["error"] and stats["streamed"] == streamed
    assert d.take_invalid_blocks() == {0, 1}  # vLLM recomputes them
    assert counters.data["checksum_failures_p2p"] == 1 and counters.data["read_failures"] == 1


def test_a_lease_p_has_not_heard_of_yet_is_checked_on_the_blocks_d_read(pair):
    """D's notification came before P's worker learned the lease (a long step): P checksums the blocks D names."""
    p, d = pair()
    p._seals.wait_s = 0.1
    res, stats, _ = _read(d, _lease(p, "req", seal=False))
    assert res.finished_recving == {"dreq"} and stats["ok"] and stats["verified"] == 2, stats
    res, stats, _ = _read(d, _lease(p, "req-flip", seal=False), fault="flip")
    assert res.failed_recving == {"dreq"} and "differ from P's checksums" in stats["error"]  # still caught


@pytest.mark.parametrize("fault", ["", "late"])
def test_a_prompt_sealed_after_its_forward_answers_d_before_p_hears_of_the_lease(pair, fault):
    """The seal made in wait_for_save (the forward that completed the prompt) answers D's notification at once,
    with no wait for the step that tells P of the lease; a write after it still shows."""
    p, d = pair()
    p._seals.wait_s = 5.0  # a wait would show in the read's time
    p.after_forward(PdserveMeta(seal_now={"req": (3, 4)}, faults={"req": fault} if fault else {}))
    if fault:
        time.sleep(0.2)  # P sealed, then wrote into the block; D reads afterwards
    t0 = time.perf_counter()
    res, stats, _ = _read(d, _lease(p, "req", seal=False))
    assert time.perf_counter() - t0 < 2.0, "D's read waited for P to hear of the lease"
    if fault:
        assert res.failed_recving == {"dreq"} and "differ from P's checksums" in stats["error"]
    else:
        assert res.finished_recving == {"dreq"} and stats["ok"] and stats["verified"] == 2, stats
    p.start(PdserveMeta(unseal=["req"]))  # request_finished: not leased after all
    assert len(p._seals) == 0


def test_ended_lease_or_foreign_fingerprint_fails_the_read(pair):
    p, d = pair()
    p._seals.wait_s = 0.1
    remote = _lease(p, "req", seal=False)
    p._seals.drop(["req"])
    res, stats, _ = _read(d, remote)
    assert res.failed_recving == {"dreq"} and "the lease ended" in stats["error"]
    d.fp_digest ^= 1  # as if D ran another model than the P that answers
    res, stats, _ = _read(d, _lease(p, "req2"))
    assert res.failed_recving == {"dreq"} and "fingerprint digest" in stats["error"]


def test_checksums_off_on_d_reads_without_verifying(pair):
    p, d = pair(d_extra={"kv_checksum": False})
    res, stats, _ = _read(d, _lease(p, "req", fault="late"))
    assert res.finished_recving == {"dreq"} and not res.failed_recving and "verified" not in stats


def test_zero_fault_corrupts_after_the_check(pair):
    """The negative control of the exactness tests still reaches vLLM: zeroing happens after verification."""
    p, d = pair()
    res, stats, _ = _read(d, _lease(p, "req"), fault="zero")
    assert not res.failed_recving and stats["ok"]
    assert torch.all(d._tensors["layer.0"][:2] == 0)


# ------------------------------------------------------------------------------------------ fingerprint
FP = {"model": "m", "model_hash": "abc", "dtype": "float32", "kv_dtype": "auto", "block_size": "16",
      "kv_layout": "x", "tp": "1", "vllm": "0.32.0", "pdserve": "dev/pdserve-kv/1", "domain": ""}


def test_fingerprint_differences_name_the_field_and_ignore_tp():
    assert differences(FP, {**FP, "tp": "2"}) == [] and digest(FP) == digest({**FP, "tp": "2"})
    assert differences({**FP, "dtype": "bfloat16"}, FP) == ["dtype: P='bfloat16' vs D='float32'"]
    assert digest({**FP, "model_hash": "abd"}) != digest(FP)
    assert parse(None) == {} and parse(FP) == FP
    with pytest.raises(ValueError):
        parse({"model": 1})


def test_model_hash_follows_config_and_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = model_hash(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert model_hash(str(tmp_path)) != first
    assert model_hash("org/model", "r1") != model_hash("org/model", "r2")


def test_d_scheduler_refuses_p_of_another_model_by_field():
    from pdserve.vllm.scheduler import SchedulerSide

    s = SchedulerSide(ConnectorConfig.from_extra({"secret": SECRET}), 4)
    s.set_handshake({0: PdserveHandshake("engine-p", "10.0.0.1", 7000, "L", fingerprint=FP)})
    tokens = list(range(100, 110))

    def request(fp):
        remote = RemoteParams("engine-p", "10.0.0.1", 7000, (7, 8, 9), 10, "p1", "L", prompt_hash(tokens, 10),
                              0.0, fingerprint=fp)
        return SimpleNamespace(request_id="d1", prompt_token_ids=tokens + [1], num_prompt_tokens=11,
                               kv_transfer_params=remote.to_params(), sampling_params=None)

    assert s.get_num_new_matched_tokens(request(FP), 0)[0] == 10
    assert s.get_num_new_matched_tokens(request({**FP, "model": "other"}), 0) == (0, False)
    refused = s._reads["d1"]["refused"]
    assert refused.startswith("fingerprint mismatch: model: P='other' vs D='m'"), refused
    assert s.get_num_new_matched_tokens(request(None), 0) == (0, False)
    assert "sent no compatibility fingerprint" in s._reads["d1"]["refused"]
