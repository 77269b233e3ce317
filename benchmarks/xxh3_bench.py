"""The indexer's XXH3 map at scale (issue 39, `pdserve indexer --xxh3`): what it costs to learn, hold, snapshot and
query Mooncake's XXH3 sequence hashes beside pdserve's keys, against the same work without it.

    python benchmarks/xxh3_bench.py --blocks 1000000 --queries 20000

Conversations of chained 128-token blocks sharing an 8-block system prompt go through the indexer's event
translator as vLLM's ``BlockStored`` events would (runs of 16 blocks, each after its parent), once into a table
alone (the baseline) and once with the XXH3 map learning the same runs. Then: ``/query_by_hash``'s work for a
conversation's leading blocks, by pdserve keys (the baseline) and by XXH3 hashes (translate, then the same lookup);
the map's memory (tracemalloc, the map alone) and its snapshot bytes and capture time. Prints a table and a final
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.conductor.events import EventTranslator  # noqa: E402
from pdserve.hashing import block_hashes, domain_root  # noqa: E402
from pdserve.indexer.table import TieredIndex  # noqa: E402
from pdserve.indexer.xxh3_keys import Xxh3Keys, seq_hashes  # noqa: E402

BS = 128
RUN = 16  # blocks per BlockStored event
W = "http://10.0.0.1:8000"


def events(blocks: int, rng: random.Random) -> tuple[list[list[dict[str, Any]]], list[list[int]]]:
    """Batches of BlockStored events storing about ``blocks`` distinct blocks, and each conversation's tokens. The
    first conversation stores the 8-block system prompt in its first run (vLLM hashes 1-8); the later ones store
    their own blocks after it (parent: vLLM hash 8)."""
    system = [rng.randrange(32000) for _ in range(8 * BS)]
    batches, convs, h, stored = [], [], 0, 0
    while stored < blocks:
        conv = system + [rng.randrange(32000) for _ in range(56 * BS)]
        convs.append(conv)
        batch: list[dict[str, Any]] = []
        first = not batches
        parent = None if first else 8
        for b in range(0 if first else 8, len(conv) // BS, RUN):
            n = min(RUN, len(conv) // BS - b)
            hashes = list(range(h + 1, h + 1 + n))
            batch.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                          "token_ids": conv[b * BS:(b + n) * BS], "block_size": BS, "lora_name": None,
                          "medium": None})
            parent, h, stored = hashes[-1], h + n, stored + n
        batches.append(batch)
    return batches, convs


def learn(batches: list[list[dict[str, Any]]], xxh3: Xxh3Keys | None) -> tuple[TieredIndex, float]:
    table, tr = TieredIndex(time.monotonic), EventTranslator(BS)
    t0 = time.perf_counter()
    for batch in batches:
        up = tr.apply(batch)
        up.apply_to(W, table)
        if xxh3 is not None:
            xxh3.learn(up.runs)
    return table, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=20000)
    p.add_argument("--seed", type=int, default=39)
    a = p.parse_args()
    rng = random.Random(a.seed)
    batches, convs = events(a.blocks, rng)
    _, base_s = learn(batches, None)
    m = Xxh3Keys(BS, 0, max_blocks=max(a.blocks * 2, 1))
    table, with_s = learn(batches, m)
    # the map alone under tracemalloc: a second one learning the same runs
    tr = EventTranslator(BS)
    runs = [r for batch in batches for r in tr.apply(batch).runs]
    tracemalloc.start()
    m2 = Xxh3Keys(BS, 0, max_blocks=max(a.blocks * 2, 1))
    before = tracemalloc.get_traced_memory()[0]
    m2.learn(runs)
    map_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del m2, runs
    queries = []
    for _ in range(a.queries):
        conv = rng.choice(convs)
        n = rng.randrange(8, len(conv) // BS + 1) * BS
        queries.append((block_hashes(conv[:n], BS), seq_hashes(conv[:n], BS)))
    root = domain_root()
    lat_keys, lat_xxh3 = [], []
    for keys, hashes in queries:
        t = time.perf_counter()
        table.lookup(keys)
        lat_keys.append(time.perf_counter() - t)
        t = time.perf_counter()
        table.lookup(m.keys(hashes, root))
        lat_xxh3.append(time.perf_counter() - t)
    same = all(table.lookup(k) == table.lookup(m.keys(x, root)) for k, x in queries[:200])
    t = time.perf_counter()
    cap = m.capture()
    capture_s = time.perf_counter() - t
    snap_bytes = sum(len(v) for v in cap.values() if isinstance(v, bytes))
    t = time.perf_counter()
    Xxh3Keys(BS, 0, max_blocks=max(a.blocks * 2, 1)).restore(cap)
    restore_s = time.perf_counter() - t
    p50 = statistics.median
    out = {"bench": "xxh3", "blocks": len(m), "learn_s_without": round(base_s, 2), "learn_s_with": round(with_s, 2),
           "learn_ratio": round(with_s / base_s, 2), "map_mib": round(map_bytes / 2**20, 1),
           "map_bytes_per_block": round(map_bytes / max(len(m), 1)), "snapshot_mib": round(snap_bytes / 2**20, 1),
           "snapshot_capture_ms": round(capture_s * 1e3, 1), "restore_ms": round(restore_s * 1e3, 1),
           "query_p50_us_keys": round(p50(lat_keys) * 1e6, 1), "query_p50_us_xxh3": round(p50(lat_xxh3) * 1e6, 1),
           "query_ratio": round(p50(lat_xxh3) / p50(lat_keys), 2), "same_answers": same,
           "load": round(os.getloadavg()[0], 1)}
    rows = [("distinct blocks learned", out["blocks"]),
            ("learn events (s): table alone / with the XXH3 map", f"{out['learn_s_without']} / {out['learn_s_with']}"
             f" ({out['learn_ratio']}x)"),
            ("XXH3 map memory (MiB; bytes per block)", f"{out['map_mib']} ({out['map_bytes_per_block']})"),
            ("XXH3 map in the snapshot (MiB; capture ms; restore ms)",
             f"{out['snapshot_mib']} ({out['snapshot_capture_ms']}; {out['restore_ms']})"),
            ("query p50 (us): pdserve keys / XXH3 hashes", f"{out['query_p50_us_keys']} / "
             f"{out['query_p50_us_xxh3']} ({out['query_ratio']}x)"),
            ("same answers (200 queries)", same)]
    for name, value in rows:
        print(f"{name:58} {value}")
    print(json.dumps(out))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
