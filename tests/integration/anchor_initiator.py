"""Initiator for the optional-backend tests, in its own process (NIXL crashes at interpreter exit).

argv: backend, peer descriptor as JSON, secret. Writes a seeded pattern and a scattered batch into
the peer's region "mem", reads it back, and prints one JSON line of results; ends with os._exit.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from pdserve.transfer import TransferConfig, TransferEngine


def main() -> None:
    backend, peer, secret = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    peer["backends"] = {k: ({kk: bytes(vv) if isinstance(vv, list) else vv for kk, vv in v.items()})
                        for k, v in peer["backends"].items()}
    out: dict = {}
    engine = TransferEngine(TransferConfig(secret=secret, backend=backend))
    size = peer["regions"]["mem"][1]
    src = np.random.default_rng(99).integers(0, 256, size, dtype=np.uint8)
    back = np.zeros(size, dtype=np.uint8)
    engine.register("src", src)
    engine.register("back", back)
    engine.submit(peer, [("src", 0, "mem", 0, size // 2)], backend=backend, notify=b"anchor-1").result(30)
    half, block = size // 2, 1024  # 4096 entries for an 8 MiB region: past Mooncake's per-call limit
    order = np.random.default_rng(1).permutation(half // block)
    entries = [("src", half + i * block, "mem", half + int(j) * block, block) for i, j in enumerate(order)]
    engine.submit(peer, entries, backend=backend).result(30)
    engine.submit(peer, [("back", 0, "mem", 0, size)], "read", backend=backend).result(30)
    expected = src.copy()
    for i, j in enumerate(order):
        expected[half + j * block : half + (j + 1) * block] = src[half + i * block : half + (i + 1) * block]
    out["read_back_equal"] = bool((back == expected).all())
    out["backend_used"] = engine.choose_backend(engine.fetch_segment(peer["host"], peer["port"]), backend).name
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
