"""Run by test_warm_start.py as ``python -m tests.unit.warm_child ARGS`` through a warm starter: prints what it was
started with as one JSON line, then sleeps (``sleep``) or exits with the code it was given."""

import json
import os
import sys
import time

print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("WARM_TEST"), "pid": os.getpid(),
                  "pgid": os.getpgid(0), "name": __name__, "stdin": sys.stdin.read(),
                  "affinity": sorted(os.sched_getaffinity(0)),
                  "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None}), flush=True)
if sys.argv[1:2] == ["sleep"]:
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else 0)
