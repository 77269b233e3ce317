"""A transfer engine in its own process, driven by line commands on stdin (test harness only).

Starts an engine with region "mem" of N bytes filled from seed S, prints its descriptor as one JSON
line, then answers: "sha OFF LEN" (hex digest of that range), "notes" (notifications so far as a
JSON list), "ping", "quit".
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from pdserve.transfer import TransferConfig, TransferEngine


def main() -> None:
    size, seed, secret = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    engine = TransferEngine(TransferConfig(secret=secret))
    mem = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    engine.register("mem", mem)
    desc = engine.segment().to_wire()
    print(json.dumps(desc), flush=True)
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


if __name__ == "__main__":
    main()
