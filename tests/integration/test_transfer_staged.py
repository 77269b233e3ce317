"""Two processes, the real TCP backend, regions registered as staged memory (the host copier stands in
for the CUDA one): the owner stages what it sends and what it receives, and so does the initiator."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from pdserve.transfer import Op, TransferConfig, TransferEngine
from pdserve.transfer.staging import HostMemory

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SECRET = "staged-test-secret-0123"
KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB  # small staging buffers: every transfer crosses many chunks

OWNER = r"""
import hashlib, os, sys
import msgpack, numpy as np
from pdserve.transfer import TransferConfig, TransferEngine
from pdserve.transfer.staging import HostMemory
size, seed, secret, chunk = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
engine = TransferEngine(TransferConfig(secret=secret, backend="tcp", staging_chunk_bytes=chunk))
mem = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
engine.register("mem", HostMemory(memoryview(mem), int(mem.ctypes.data)))
sys.stdout.write(msgpack.packb(engine.segment().to_wire()).hex() + "\n"); sys.stdout.flush()
for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
        break
    off, n = int(cmd[1]), int(cmd[2])
    print(hashlib.sha256(mem[off:off + n].tobytes()).hexdigest(), flush=True)
engine.close()
os._exit(0)
"""


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def staged(arr: np.ndarray) -> HostMemory:
    return HostMemory(memoryview(arr), int(arr.ctypes.data))


@pytest.fixture
def owner():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(8 * MiB), "5", SECRET, str(CHUNK)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    desc = msgpack.unpackb(bytes.fromhex(proc.stdout.readline().strip()), raw=False)

    def sha(off: int, n: int) -> str:
        proc.stdin.write(f"sha {off} {n}\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    yield desc, sha
    proc.stdin.close()
    proc.wait(timeout=30)


@pytest.fixture
def engine():
    eng = TransferEngine(TransferConfig(secret=SECRET, backend="tcp", streams=2, slice_bytes=1 * MiB,
                                        staging_chunk_bytes=CHUNK))
    yield eng
    eng.close()


def scattered(n: int, block: int, region_blocks: int, seed: int) -> list[tuple[int, int]]:
    """n (local block, peer block) pairs, peer blocks shuffled and spread over the region."""
    peer = np.random.default_rng(seed).choice(region_blocks, n, replace=False)
    return [(i, int(j)) for i, j in enumerate(peer)]


def test_read_of_scattered_blocks_from_a_staged_region_is_byte_exact(owner, engine):
    desc, _ = owner
    block = 48 * KiB + 16  # not a divisor of the chunk: blocks straddle staging buffers
    pairs = scattered(60, block, 8 * MiB // block, seed=1)
    dst = np.zeros(64 * block, np.uint8)
    engine.register("dst", staged(dst))
    engine.submit(desc, [("dst", i * block, "mem", j * block, block) for i, j in pairs], Op.READ).result(timeout=60)
    src = pattern(8 * MiB, 5)
    for i, j in pairs:
        assert dst[i * block : (i + 1) * block].tobytes() == src[j * block : (j + 1) * block].tobytes()
    assert not dst[60 * block :].any()
    assert any(engine.ctx.staging._idle.values())  # the copies went through staging buffers


def test_write_of_scattered_blocks_into_a_staged_region_touches_nothing_else(owner, engine):
    desc, sha = owner
    block = 32 * KiB
    src = pattern(2 * MiB, 9)
    engine.register("src", staged(src))
    pairs = scattered(50, block, 8 * MiB // block, seed=2)
    engine.submit(desc, [("src", i * block, "mem", j * block, block) for i, j in pairs], Op.WRITE).result(timeout=60)
    expected = pattern(8 * MiB, 5)
    for i, j in pairs:
        expected[j * block : (j + 1) * block] = src[i * block : (i + 1) * block]
    assert sha(0, 8 * MiB) == hashlib.sha256(expected.tobytes()).hexdigest()


def test_mixed_host_and_staged_entries_in_one_batch(owner, engine):
    desc, _ = owner
    plain, stage = np.zeros(MiB, np.uint8), np.zeros(MiB, np.uint8)
    engine.register("plain", plain)
    engine.register("stage", staged(stage))
    entries = [("plain", 0, "mem", 0, 300 * KiB), ("stage", 10, "mem", MiB, 700 * KiB),
               ("plain", 500 * KiB, "mem", 3 * MiB, 5)]
    engine.submit(desc, entries, Op.READ).result(timeout=60)
    src = pattern(8 * MiB, 5)
    assert plain[: 300 * KiB].tobytes() == src[: 300 * KiB].tobytes()
    assert stage[10 : 10 + 700 * KiB].tobytes() == src[MiB : MiB + 700 * KiB].tobytes()
    assert plain[500 * KiB : 500 * KiB + 5].tobytes() == src[3 * MiB : 3 * MiB + 5].tobytes()
    assert not stage[:10].any() and not stage[10 + 700 * KiB :].any()
