"""The KV indexer at scale (issue 39): snapshot size and time, restore time, and lookups per second and p99, at
1M indexed blocks over many workers, with the lookups a router makes (a prompt's block keys -> every worker's
prefix per tier).

    python benchmarks/indexer_bench.py --workers 1000 --blocks 1000000 --lookups 20000

The table is filled as the event feed fills it (one translator per worker: vLLM hash -> pdserve key per tier,
and the tiered index), from conversations of chained blocks sharing a system prefix, each placed on a few
workers, a tenth of the blocks also in the workers' host tier. Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.conductor.events import EventTranslator  # noqa: E402
from pdserve.conductor.tiers import HOST, holder_of  # noqa: E402
from pdserve.hashing import block_hashes  # noqa: E402
from pdserve.indexer.service import IndexerConfig, IndexerService  # noqa: E402
from pdserve.router.fleet.kv_events import Publisher, batch_digest  # noqa: E402

BS = 128
LAST = b"last batch"


async def _replay(ctx, endpoint, start):  # the workers still hold the snapshot's last batch
    return [(start, LAST)]


def conversation(system: list[int], blocks: int, rng: random.Random) -> list[int]:
    """Block keys of one conversation: the shared system prompt, then its own tokens."""
    tail = [rng.randrange(32000) for _ in range((blocks - 8) * BS)]
    return block_hashes(system + tail, BS)


def fill(svc: IndexerService, workers: int, total: int, rng: random.Random) -> list[list[int]]:
    assert svc.feed is not None
    per_conv, copies = 64, 3
    convs: list[list[int]] = []
    trs = {f"http://10.0.{w // 250}.{w % 250}:8000": EventTranslator(BS) for w in range(workers)}
    names = list(trs)
    h = 0
    system = [rng.randrange(32000) for _ in range(8 * BS)]
    held: dict[str, set[int]] = {w: set() for w in names}  # distinct keys per worker (the system prompt repeats)
    entries = 0
    while entries < total:
        keys = conversation(system, per_conv, rng)
        convs.append(keys)
        for w in rng.sample(names, copies):
            tr, mine = trs[w], held[w]
            depth = rng.randrange(8, len(keys) + 1)
            for k in keys[:depth]:
                if k in mine:
                    continue
                mine.add(k)
                h += 1
                tr.keys[h] = k
                entries += 1
                if rng.random() < 0.1:
                    tr.tiers.setdefault(HOST, {})[h] = k
                    entries += 1
    for w, tr in trs.items():
        tr.last_seq, tr.last_digest = 1000, batch_digest(LAST)
        for tier, m in tr.tiers.items():
            svc.table.blocks_stored(holder_of(w, tier), list(m.values()))
        svc.feed.resume(w, Publisher(f"tcp://127.0.0.1:{1 + len(w) % 7}", "tcp://127.0.0.1:9"), tr, tr.last_digest)
    return convs


def entries(svc: IndexerService) -> int:
    ix = svc.table.index
    return sum(ix.blocks_of(h) for h in ix.holders())


async def run(a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    path = Path(tempfile.mkdtemp(prefix="pdserve-indexer-bench-")) / "index.snap"
    cfg = IndexerConfig(block_size=BS, snapshot_path=str(path), snapshot_interval_s=0)
    svc = IndexerService(cfg, replayer=_replay)
    await svc.start()
    t0 = time.perf_counter()
    convs = fill(svc, a.workers, a.blocks, rng)
    await asyncio.sleep(0.05)  # the resumes' replays (the workers' last batch) land
    fill_s = time.perf_counter() - t0
    n = entries(svc)
    snaps = [await svc.snapshot_now() for _ in range(a.repeat)]
    capture = statistics.median(s.capture_s for s in snaps[-a.repeat:])
    write = statistics.median(s.write_s for s in snaps[-a.repeat:])
    size = snaps[-1].bytes
    # lookups: a conversation's first blocks plus new ones (what a router asks per request)
    prompts = []
    for _ in range(a.lookups):
        keys = rng.choice(convs)
        d = rng.randrange(8, len(keys) + 1)
        prompts.append(keys[:d] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 8))])
    lat = []
    t0 = time.perf_counter()
    for keys in prompts:
        s = time.perf_counter()
        svc.table.lookup(keys)
        lat.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    lat.sort()
    await svc.close(final_snapshot=False)
    # restore: a new indexer from the file (read, translators, index), streams resumed
    restores = []
    for _ in range(a.repeat):
        r = IndexerService(cfg, replayer=_replay)
        t0 = time.perf_counter()
        await r.start()
        restores.append((time.perf_counter() - t0, r.stats.restore_s))
        await asyncio.sleep(0.05)
        same = entries(r) == n and r.feed is not None and r.feed.clears == 0
        await r.close(final_snapshot=False)
    os.unlink(path)
    return {"workers": a.workers, "entries": n, "keys": len(svc.table.index), "fill_s": round(fill_s, 2),
            "snapshot_bytes": size, "snapshot_capture_ms": round(capture * 1e3, 1),
            "snapshot_write_ms": round(write * 1e3, 1),
            "restore_ms": round(statistics.median(x[0] for x in restores) * 1e3, 1),
            "restore_rebuild_ms": round(statistics.median(x[1] for x in restores) * 1e3, 1),
            "restored_equal": same, "lookups": len(lat), "lookups_per_s": round(len(lat) / wall),
            "lookup_p50_us": round(lat[len(lat) // 2] * 1e6, 1),
            "lookup_p99_us": round(lat[int(len(lat) * .99)] * 1e6, 1),
            "load": os.getloadavg()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=1_000_000, help="indexed (worker, block) entries, about")
    p.add_argument("--lookups", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=39)
    a = p.parse_args()
    r = asyncio.run(run(a))
    print("| entries | workers | snapshot MB | capture ms | write ms | restore ms (of it rebuild) | lookups/s | "
          "lookup p50 us | p99 us |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {r['entries']:,} | {r['workers']} | {r['snapshot_bytes'] / 1e6:.1f} | {r['snapshot_capture_ms']} | "
          f"{r['snapshot_write_ms']} | {r['restore_ms']} ({r['restore_rebuild_ms']}) | {r['lookups_per_s']:,} | "
          f"{r['lookup_p50_us']} | {r['lookup_p99_us']} |")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
