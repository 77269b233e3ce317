"""Issue 27's measure: injected KV corruptions detected, by path (goal 100%, with 0 wrong answers).

    python benchmarks/corruption_tally.py [--pool] [--from TALLY.jsonl]

Runs tests/integration/test_kv_integrity.py (and, with --pool, test_store_vllm.py) with real vLLM workers and
``$PDSERVE_CORRUPTION_TALLY`` set; each fault case records whether its corruption was detected and whether the
answer still equalled one worker's (tests/integration/corruption_tally.py). Prints a table per path (p2p: a byte
flipped in transit; late_write: P's block written after its seal, before D's read; foreign_p: a P of another model
or dtype; pool: a byte flipped in a pool object) and a final JSON line: <path>_injected, <path>_detected,
<path>_wrong_answers, detected_share.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", action="store_true", help="also the pool object case (one more vLLM worker)")
    ap.add_argument("--from", dest="source", default="", help="count this tally file (written by a test run with "
                                                                  "$PDSERVE_CORRUPTION_TALLY) instead of running")
    args = ap.parse_args()
    rc = 0
    if args.source:
        rows = [json.loads(line) for line in open(args.source)]
    else:
        rc, rows = run_tests(args.pool)
    summarize(rows, rc)


def run_tests(pool: bool) -> tuple[int, list[dict]]:
    tests = ["tests/integration/test_kv_integrity.py"] + (["tests/integration/test_store_vllm.py"] if pool else [])
    with tempfile.TemporaryDirectory() as tmp:
        tally = os.path.join(tmp, "tally.jsonl")
        env = dict(os.environ, PDSERVE_CORRUPTION_TALLY=tally, PYTHONPATH=ROOT)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                              env=env, capture_output=True, text=True)
        print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:], file=sys.stderr)
        return proc.returncode, [json.loads(line) for line in open(tally)] if os.path.exists(tally) else []


def summarize(rows: list[dict], rc: int) -> None:
    by_path: dict[str, dict[str, int]] = defaultdict(lambda: {"injected": 0, "detected": 0, "wrong_answers": 0})
    for row in rows:
        counts = by_path[row["path"]]
        counts["injected"] += 1
        counts["detected"] += 1 if row["detected"] else 0
        counts["wrong_answers"] += 0 if row["exact"] else 1
    print(f"{'path':<12}{'injected':>10}{'detected':>10}{'wrong answers':>15}")
    result: dict[str, float] = {}
    for path, counts in sorted(by_path.items()):
        print(f"{path:<12}{counts['injected']:>10}{counts['detected']:>10}{counts['wrong_answers']:>15}")
        result.update({f"{path}_{k}": v for k, v in counts.items()})
    injected = sum(c["injected"] for c in by_path.values())
    result["detected_share"] = round(sum(c["detected"] for c in by_path.values()) / injected, 3) if injected else 0.0
    result["tests_rc"] = rc
    print(json.dumps(result))


if __name__ == "__main__":
    main()
