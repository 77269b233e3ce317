"""A transfer engine in its own process, driven by line commands on stdin (test harness only).

Starts an engine (optional 4th argument: backend) with region "mem" of N bytes filled from seed S, prints its descriptor as one JSON
line, then answers: "sha OFF LEN" (hex digest of that range), "notes" (notifications so far as a
JSON list), "ping", "quit".
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np

from pdserve.transfer import TransferConfig, TransferEngine


def _jsonable(desc: dict) -> dict:
    """Descriptor as JSON (NIXL metadata is bytes: sent as a list of ints)."""
    backends = {k: {kk: list(vv) if isinstance(vv, bytes) else vv for kk, vv in v.items()}
                for k, v in desc["backends"].items()}
    return dict(desc, backends=backends)


def main() -> None:
    size, seed, secret = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    backend = sys.argv[4] if len(sys.argv) > 4 else "auto"
    engine = TransferEngine(TransferConfig(secret=secret, backend=backend))
    mem = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    engine.register("mem", mem)
    desc = engine.segment().to_wire()
    print(json.dumps(_jsonable(desc)), flush=True)
    notes: list[str] = []
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "sha":
            off, n = int(cmd[1]), int(cmd[2])
            print(hashlib.sha256(mem[off : off + n].tobytes()).hexdigest(), flush=True)
        elif cmd[0] == "notes":
            notes += [n.message.decode() if isinstance(n.message, bytes) else n.message
                      for n in engine.get_notifications()]
            print(json.dumps(notes), flush=True)
        elif cmd[0] == "ping":
            print("pong", flush=True)
    engine.close()
    os._exit(0)  # NIXL can crash in interpreter teardown


if __name__ == "__main__":
    main()
