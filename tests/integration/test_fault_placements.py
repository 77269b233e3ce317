"""Issue 41: KV corruption at random places, on every path the checksums cover, is never used.

Each placement XORs one to four bytes at random offsets of random units (any block of the read, any layer, K or V
run; :mod:`pdserve.vllm.flips`) and must fail the read (vLLM would recompute) or reject the pool object:

* ``p2p``: TP 1 -> 1, D's bytes flipped in transit (``flip~SEED``), hashed after the read or as it lands;
* ``p2p_tp``: TP 2 -> 1 and 1 -> 2, reads that reshard heads (checked per head slice);
* ``late_write``: P's sealed blocks written after the seal, before D reads (``late~SEED``);
* ``pool_disk``: objects of the KV pool spilled to a store node's disk tier (a real master and node process),
  their files changed on disk, then loaded back (the node promotes them to memory and D reads them).

The connector's worker half (``WorkerSide``) runs in this process over real transfer engines (TCP, the same as
between hosts) with KV caches in vLLM's CPU layout and made-up bytes: no vLLM forward (test_kv_integrity.py's cases
run through vLLM). ``$PDSERVE_FAULT_PLACEMENTS`` placements per path (default 6 in the test command;
``benchmarks/corruption_tally.py --placements 60`` runs 240). Each writes its row to ``$PDSERVE_CORRUPTION_TALLY``
before it injects (tests/integration/corruption_tally.py), so a stalled one counts as undetected.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdserve.launch.procs import free_port

from .conftest import ROOT, SECRET
from .corruption_tally import injected

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

vllm = pytest.importorskip("vllm")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from pdserve.vllm.flips import placements  # noqa: E402
from pdserve.vllm.messages import PdserveMeta, PoolJob, RecvJob  # noqa: E402
from pdserve.vllm.params import BlockPlan, ConnectorConfig, RemoteParams  # noqa: E402
from pdserve.vllm.shards import rank_heads  # noqa: E402
from pdserve.vllm.worker import WorkerSide  # noqa: E402

N = int(os.environ.get("PDSERVE_FAULT_PLACEMENTS", "6"))
BS, NB, HEADS, D, LAYERS = 16, 24, 2, 32, 3  # a block: 3 layers x 2 heads x 16 tokens x (K, V) x 32 fp32 = 24 KiB
READ = 4  # blocks per read


def _side(tp: int = 1, rank: int = 0, seed: int = -1, **extra) -> WorkerSide:
    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS,
                                                       get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC),
                          model_config=None, parallel_config=None)
    w = WorkerSide(cfg, ConnectorConfig.from_extra({"secret": SECRET, "allow_test_faults": True, **extra}))  # type: ignore[arg-type]
    w.tp, w.rank, w.kv_heads = tp, rank, HEADS
    heads = len(rank_heads(HEADS, tp, rank))
    caches = {}
    for layer in range(LAYERS):
        cache = torch.zeros((NB, heads, BS, 2 * D), dtype=torch.float32)
        if seed >= 0:
            cache.copy_(torch.from_numpy(np.random.default_rng(seed * 10 + layer).standard_normal(cache.shape)
                                         .astype(np.float32)))
        caches[f"layer.{layer}"] = cache
    w.register_kv_caches(caches)
    return w


@pytest.fixture(scope="module")
def sides():
    made: list[WorkerSide] = []

    def make(*args, **kw) -> WorkerSide:
        made.append(_side(*args, **kw))
        return made[-1]

    yield make
    for w in made:
        w.close()


def _remote(ps: list[WorkerSide], req: str, blocks: tuple[int, ...], fault: str = "") -> RemoteParams:
    hs = [p.handshake() for p in ps]
    ranks = tuple((h.engine_id, h.host, h.port) for h in hs) if len(ps) > 1 else ()
    return RemoteParams(hs[0].engine_id, hs[0].host, hs[0].port, blocks, len(blocks) * BS, req, hs[0].layout, "",
                        time.time() + 30, fault, ranks, HEADS, hs[0].unit)


def _seal(ps: list[WorkerSide], req: str, blocks: tuple[int, ...], fault: str = "") -> None:
    """Lease and seal ``blocks`` on every P rank; wait for the seals (and a late fault's write after them)."""
    for p in ps:
        p.start(PdserveMeta(send={req: time.time() + 30}, seal={req: blocks}, faults={req: fault} if fault else {}))
        p._seals._sealed[req][1].result(timeout=10)


def _layers(w: WorkerSide, fault: str, blocks: tuple[int, ...]) -> list[str]:
    """The layers ``fault``'s placements hit in a read of ``blocks`` into ``w``."""
    units = w.sums.units(blocks[0])
    return sorted({units[k][0] for _, k, _, _ in placements(fault, [n for _, _, n in units], len(blocks))})


def _read(d: WorkerSide, remote: RemoteParams, local: tuple[int, ...]) -> dict:
    d._run(RecvJob(f"d-{remote.request_id}", remote, BlockPlan(local, remote.block_ids)))
    res = d.results()
    d.take_invalid_blocks()
    stats = d.take_worker_meta().reads[f"d-{remote.request_id}"]
    stats["failed"] = f"d-{remote.request_id}" in res.failed_recving
    return stats


def _caught(stats: dict) -> bool:
    return stats["failed"] and not stats["ok"] and bool(stats.get("checksum_failed"))


def _pick(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
    blocks = rng.sample(range(NB), 2 * READ)
    return tuple(blocks[:READ]), tuple(blocks[READ:])


def test_random_flips_in_transit_tp1(sides):
    p, d = sides(seed=1), sides()
    rng = random.Random(41)
    missed = []
    for i in range(N):
        remote_blocks, local = _pick(rng)
        d.verifier.min_bytes = 0 if i % 2 else 1 << 40  # hashed as the read lands, or after it
        req, fault = f"p2p-{i}", f"flip~{rng.randrange(1 << 30)}"
        _seal([p], req, remote_blocks)
        case = injected("p2p", f"{fault} ({'as it lands' if i % 2 else 'after the read'})",
                        layers=_layers(d, fault, local))
        stats = _read(d, _remote([p], req, remote_blocks, fault), local)
        case.done(_caught(stats))
        if not _caught(stats):
            missed.append((fault, stats))
        _seal([p], req + "-clean", remote_blocks)
        clean = _read(d, _remote([p], req + "-clean", remote_blocks), local)
        assert clean["ok"] and clean["verified"] == READ, clean  # no false alarm on the same blocks
    assert not missed, missed


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_random_flips_in_resharded_reads(sides, p_tp, d_tp):
    ps = [sides(p_tp, r, seed=2 + r) for r in range(p_tp)]
    ds = [sides(d_tp, r) for r in range(d_tp)]
    rng = random.Random(100 * p_tp + d_tp)
    missed = []
    for i in range(N):
        remote_blocks, local = _pick(rng)
        rank = rng.randrange(d_tp)
        fault = f"flip~{rng.randrange(1 << 30)}@{rank}" if d_tp > 1 else f"flip~{rng.randrange(1 << 30)}"
        req = f"tp{p_tp}{d_tp}-{i}"
        _seal(ps, req, remote_blocks)
        case = injected("p2p_tp", f"{fault} (TP {p_tp} -> {d_tp})", layers=_layers(ds[rank], fault, local))
        results = [_read(d, _remote(ps, req, remote_blocks, fault), local) for d in ds]
        case.done(_caught(results[rank]))
        if not _caught(results[rank]):
            missed.append((fault, results[rank]))
        assert all(r["ok"] and r["verified"] == READ for j, r in enumerate(results) if j != rank), results
        _seal(ps, req + "-clean", remote_blocks)
        clean = [_read(d, _remote(ps, req + "-clean", remote_blocks), local) for d in ds]
        assert all(r["ok"] and r["verified"] == READ for r in clean), clean  # no false alarm
    assert not missed, missed


def test_random_late_writes_into_sealed_blocks(sides):
    p, d = sides(seed=5), sides()
    rng = random.Random(7)
    missed = []
    for i in range(N):
        remote_blocks, local = _pick(rng)
        req, fault = f"late-{i}", f"late~{rng.randrange(1 << 30)}"
        case = injected("late_write", fault, layers=_layers(p, fault, remote_blocks))
        _seal([p], req, remote_blocks, fault)  # P sealed, then wrote into its blocks
        stats = _read(d, _remote([p], req, remote_blocks), local)
        case.done(_caught(stats))
        if not _caught(stats):
            missed.append((fault, stats))
    assert not missed, missed


# ---------------------------------------------------------------------------------------------- pool, disk tier
class _Store:
    """A pool master and one node with a memory arena and a disk tier, as real processes; the master's watermarks
    (0.2% / 0.1% of the arena) spill every object to disk and drop its memory copy as soon as it is stored."""

    def __init__(self, disk: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_TRANSFER_SECRET=SECRET)
        self.port = free_port()
        self.disk = disk
        args = [["master", "--port", str(self.port), "--high-watermark", "0.002", "--low-watermark", "0.001"],
                ["node", "--master", f"127.0.0.1:{self.port}", "--mem", "4MiB", "--disk-dir", str(disk),
                 "--disk", "256MiB", "--node-id", "n0", "--heartbeat-s", "0.2"]]
        self.procs = []
        for a in args:
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.store.cli", *a], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
            self.procs.append(proc)
            assert proc.stdout.readline(), f"pdserve store {a[0]} exited with {proc.wait()}"

    def file(self, key: int) -> Path:
        return self.disk / f"{key:016x}.kv"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            proc.stdout.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = _Store(tmp_path_factory.mktemp("pool-disk"))
    yield s
    s.stop()


def _on_disk_only(store: _Store, w: WorkerSide, keys: tuple[int, ...], timeout: float = 10.0) -> bool:
    """Whether every object of ``keys`` was spilled to the node's disk and left its memory in time."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pool = w.pool.stats() if w.pool is not None else {}
        if all(store.file(k).exists() for k in keys) and pool.get("nodes") == 1 and pool["objects_mem"] == 0:
            return True  # every object's memory copy was dropped once its spill ended: on disk only
        time.sleep(0.05)
    return False


def test_random_flips_in_pool_objects_on_disk(sides, store):
    w = sides(seed=9, pool_master=f"127.0.0.1:{store.port}")
    assert w._pool_io is not None
    sizes = [n for _, _, n in w.sums.units(0)]
    rng = random.Random(27)
    missed = []
    for i in range(N):
        src, dst = _pick(rng)
        keys = tuple(rng.randrange(1, 1 << 62) for _ in src)
        # the node registers with the master from its heartbeat thread, after it printed its address: a first save
        # before that finds no node ("full": CI, 2026-12-05); the last load promoted its objects into the node's 4 MiB
        # memory, and the watermarks drop them again, later on a loaded machine (a save meanwhile finds it full: CI16)
        assert _on_disk_only(store, w, ()), f"no registered node with empty memory: {w.pool.stats()}"
        good, stats = w._pool_io.run(PoolJob(f"save-{i}", keys, src, save=True))
        assert good == READ and stats["stored"] == READ, (stats, w.pool.stats())
        assert _on_disk_only(store, w, keys), "the objects did not spill to the disk tier"
        fault = f"flip~{rng.randrange(1 << 30)}"
        flips = placements(fault, sizes, READ)
        case = injected("pool_disk", fault, layers=sorted({w.sums.units(0)[k][0] for _, k, _, _ in flips}))
        for slot, k, at, mask in flips:  # the object: the block's units in order, then its seal
            with open(store.file(keys[slot]), "r+b") as f:
                f.seek(sum(sizes[:k]) + at)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ mask]))
        promotes = w.pool.stats()["promotes"]
        loaded, stats = w._pool_io.run(PoolJob(f"load-{i}", keys, dst, save=False))
        assert w.pool.stats()["promotes"] > promotes, "the load did not come from the disk tier"
        first_bad = min(slot for slot, *_ in flips)
        caught = loaded <= first_bad and bool(stats.get("seal_failures"))
        case.done(caught)
        if not caught:
            missed.append((fault, loaded, stats))
        for s, t in zip(src[:loaded], dst[:loaded]):  # what was used is byte for byte what was saved
            assert w.sums.sums([s]) == w.sums.sums([t])
    assert not missed, missed
