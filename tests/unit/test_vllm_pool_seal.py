"""Issue 27 for the KV pool: every object carries a seal (the writer's fingerprint digest and the block's checksum)
next to its bytes; a reader uses a loaded block only when the seal is its own fingerprint and the checksum matches
what arrived, else the block and the ones after it are a miss (recomputed). The pool here is a dict standing in
for StoreClient (same put / get_into contract: objects are the concatenation of their pieces)."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.transfer.checksum import XXH3
from pdserve.vllm.integrity import BlockSums
from pdserve.vllm.messages import PoolJob
from pdserve.vllm.params import LayerGeometry
from pdserve.vllm.pool import SEAL_BYTES, SEAL_REGION, SealSlots, pool_items, seal_problem
from pdserve.vllm.pool_io import PoolIO

BLOCK = 64
NB = 8


class DictPool:
    """put / get_into over a dict of key -> bytes, reading and writing the caller's regions like the real client."""

    def __init__(self, memory: dict[str, np.ndarray]) -> None:
        self.memory, self.objects = memory, {}

    def put(self, items):
        out = []
        for key, pieces in items:
            if key in self.objects:
                out.append("exists")
                continue
            self.objects[key] = b"".join(self.memory[r][o:o + n].tobytes() for r, o, n in pieces)
            out.append("stored")
        return out

    def remove(self, keys):
        return sum(self.objects.pop(k, None) is not None for k in keys)

    def get_into(self, items):
        got = []
        for key, pieces in items:
            data = self.objects.get(key)
            if data is None or len(data) != sum(n for _, _, n in pieces):
                got.append(False)
                continue
            at = 0
            for r, o, n in pieces:
                self.memory[r][o:o + n] = np.frombuffer(data[at:at + n], dtype=np.uint8)
                at += n
            got.append(True)
        return got


def _worker(fp: int, shared: DictPool | None = None, checksum: bool = True):
    kv = np.random.default_rng(fp).integers(0, 256, NB * BLOCK, dtype=np.uint8)
    slots = SealSlots(64)
    memory = {"kv": kv, SEAL_REGION: slots.buffer}
    pool = shared or DictPool(memory)
    pool.memory = memory
    layers = [LayerGeometry("kv", BLOCK, BLOCK)]
    return PoolIO(pool, layers, BlockSums(layers, {"kv": kv}), slots, fp, checksum, BLOCK), kv, pool  # type: ignore[arg-type]


def test_seal_slots_round_trip_and_problems():
    slots = SealSlots(4)
    taken = slots.take(3)
    assert len(taken) == 3 and slots.take(2) == []
    slots.write(taken[0], XXH3, 0xAB, 0xCD)
    assert slots.read(taken[0]) == (XXH3, 0xAB, 0xCD) and slots.read(taken[1]) is None
    slots.give(taken)
    assert len(slots.take(4)) == 4
    assert seal_problem((XXH3, 1, 5), 1, 5) == "" and "checksum" in seal_problem((XXH3, 1, 5), 1, 6)
    assert "fingerprint" in seal_problem((XXH3, 2, 5), 1, 5) and "no seal" in seal_problem(None, 1, 5)
    assert "no checksum" in seal_problem(("", 1, 0), 1, 5) and seal_problem(("", 1, 0), 1, None) == ""
    items = pool_items([LayerGeometry("kv", BLOCK, BLOCK)], [11], [2], [3])
    assert items == [(11, [("kv", 2 * BLOCK, BLOCK), (SEAL_REGION, 3 * SEAL_BYTES, SEAL_BYTES)])]


def test_sealed_blocks_load_back_exactly():
    writer, kv, pool = _worker(fp=1)
    good, stats = writer.run(PoolJob("w", (101, 102, 103), (0, 1, 2), True))
    assert good == 3 and stats["stored"] == 3
    reader, kv2, _ = _worker(fp=1, shared=pool)
    good, stats = reader.run(PoolJob("r", (101, 102, 103), (5, 6, 7), False))
    assert good == 3 and "seal_failures" not in stats
    assert np.array_equal(kv2[5 * BLOCK:8 * BLOCK], kv[:3 * BLOCK])


def test_flipped_byte_in_a_pool_object_is_a_miss_from_there_on():
    writer, _, pool = _worker(fp=1)
    writer.run(PoolJob("w", (101, 102, 103), (0, 1, 2), True))
    obj = bytearray(pool.objects[102])
    obj[17] ^= 0x01  # corruption at rest (or on the node's link)
    pool.objects[102] = bytes(obj)
    reader, _, _ = _worker(fp=1, shared=pool)
    good, stats = reader.run(PoolJob("r", (101, 102, 103), (5, 6, 7), False))
    assert good == 1 and stats["seal_failures"] == 1 and stats["bytes"] == BLOCK
    assert sorted(pool.objects) == [101, 103]  # the corrupt object is removed: no reader can use it


def test_another_models_blocks_are_never_served():
    writer, _, pool = _worker(fp=1)
    writer.run(PoolJob("w", (101, 102), (0, 1), True))
    other, _, _ = _worker(fp=2, shared=pool)  # same geometry, another fingerprint
    good, stats = other.run(PoolJob("r", (101, 102), (5, 6), False))
    assert good == 0 and stats["seal_failures"] == 1
    assert sorted(pool.objects) == [101, 102]  # the other model's blocks stay theirs


def test_checksum_off_writer_is_refused_by_a_checking_reader_but_not_by_a_trusting_one():
    writer, _, pool = _worker(fp=1, checksum=False)
    writer.run(PoolJob("w", (101,), (0,), True))
    assert _worker(fp=1, shared=pool)[0].run(PoolJob("r", (101,), (5,), False))[0] == 0
    assert _worker(fp=1, shared=pool, checksum=False)[0].run(PoolJob("r", (101,), (5,), False))[0] == 1


def test_run_job_never_raises():
    good, stats = PoolIO.run_job(None, PoolJob("r", (1,), (2,), False))
    assert good == 0 and "no pool" in stats["error"]
    io, _, _ = _worker(fp=1)
    io.slots = SealSlots(1)
    good, stats = PoolIO.run_job(io, PoolJob("r", (1, 2), (2, 3), False))
    assert good == 0 and "seal slots" in stats["error"]


@pytest.mark.parametrize("n", [1, 3])
def test_unsealed_legacy_objects_have_another_size(n):
    """Objects written before seals existed are a block long: a reader expecting block + seal skips them."""
    io, kv, pool = _worker(fp=1)
    for k in range(n):
        pool.objects[200 + k] = kv[:BLOCK].tobytes()
    good, _ = io.run(PoolJob("r", tuple(200 + k for k in range(n)), tuple(range(n)), False))
    assert good == 0
