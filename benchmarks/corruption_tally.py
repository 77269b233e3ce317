"""Issue 27's measure: injected KV corruptions detected, by path (goal 100%, with 0 wrong answers).

    python benchmarks/corruption_tally.py [--pool] [--from TALLY.jsonl]

Runs tests/integration/test_kv_integrity.py (and, with --pool, test_store_vllm.py) with real vLLM workers and
``$PDSERVE_CORRUPTION_TALLY`` set; each fault case records whether its corruption was detected and whether the
answer still equalled one worker's (tests/integration/corruption_tally.py). Prints a table per path (p2p: a byte
flipped in transit; late_write: P's block written after its seal, before D's read; foreign_p: a P of another model
or dtype; pool: a byte flipped in a pool object) and a final JSON line: <path>_injected, <path>_detected,
<path>_undetected, <path>_stalled, <path>_wrong_answers, detected_share.

Each case writes its ``injected`` row before it injects and its outcome after, so a case that stalls or times out
counts as injected and not detected (``stalled``); the test run is killed after ``--timeout`` seconds.

    python benchmarks/corruption_tally.py --placements 240

runs tests/integration/test_fault_placements.py instead (``$PDSERVE_FAULT_PLACEMENTS`` random placements per path:
bytes flipped at random offsets of one to four units, any block and layer, on P -> D reads at TP 1 -> 1 (hashed after
the read and as it lands), TP 2 -> 1 and 1 -> 2, late writes into P's sealed blocks, and objects on the KV pool's
disk tier): the connector's worker half over real transfer engines and a real pool master and node, KV bytes made
up (no vLLM forward; test_kv_integrity.py's random cases run through vLLM).

    python benchmarks/corruption_tally.py --placements 60 --tp-vllm 40

adds tests/integration/test_fault_placements_tp_vllm.py (path ``p2p_tp_vllm``): that many random placements in TP 2 ->
1 reads through real vLLM workers (a TP 2 P and a TP 1 D server, ``kv_checksum`` on), each answer compared with D's
own (``--tp-vllm`` alone runs only those).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
    ap.add_argument("--placements", type=int, default=0, help="run test_fault_placements.py with this many random "
                                                                  "placements per path instead")
    ap.add_argument("--tp-vllm", type=int, default=0, help="also run test_fault_placements_tp_vllm.py with this many "
                                                          "random placements (TP 2 -> 1 through real vLLM)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="kill the test run after this many seconds (its "
                                                                   "unfinished cases count as stalled)")
    args = ap.parse_args()
    rc = 0
    if args.source:
        rows = [json.loads(line) for line in open(args.source)]
    else:
        rc, rows = run_tests(args.pool, args.placements, args.timeout, args.tp_vllm)
    summarize(rows, rc)


def run_tests(pool: bool, placements: int, timeout: float, tp_vllm: int = 0) -> tuple[int, list[dict]]:
    if placements or tp_vllm:
        tests = (["tests/integration/test_fault_placements.py"] if placements else []) + \
                (["tests/integration/test_fault_placements_tp_vllm.py"] if tp_vllm else [])
    else:
        tests = ["tests/integration/test_kv_integrity.py"] + (["tests/integration/test_store_vllm.py"] if pool
                                                               else [])
    with tempfile.TemporaryDirectory() as tmp:
        tally = os.path.join(tmp, "tally.jsonl")
        env = dict(os.environ, PDSERVE_CORRUPTION_TALLY=tally, PYTHONPATH=ROOT)
        if placements:
            env["PDSERVE_FAULT_PLACEMENTS"] = str(placements)
        if tp_vllm:
            env.update(PDSERVE_TP_FAULT_PLACEMENTS=str(tp_vllm), PDSERVE_TEST_SLOW="1")
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            rc = 124
            print(f"test run killed after {timeout:g} s", file=sys.stderr)
        print(out.strip().splitlines()[-1] if out.strip() else err[-2000:], file=sys.stderr)
        return rc, [json.loads(line) for line in open(tally)] if os.path.exists(tally) else []


def outcomes(rows: list[dict]) -> list[dict]:
    """One entry per injected corruption: its ``injected`` row joined with its outcome; an injection with no
    outcome (the case stalled, timed out or died) is ``stalled``: counted as injected and not detected. Rows of the
    older one-row format count as both."""
    by_id: dict[str, dict] = {}
    out: list[dict] = []
    for row in rows:
        event = row.get("event")
        if event is None:
            out.append({**row, "stalled": False})
        elif event == "injected":
            by_id[row["id"]] = entry = {**row, "detected": False, "exact": None, "stalled": True}
            out.append(entry)
        elif event == "outcome" and row.get("id") in by_id:
            by_id[row["id"]].update(detected=row["detected"], exact=row["exact"], stalled=False)
    return out


def summarize(rows: list[dict], rc: int) -> None:
    keys = ("injected", "detected", "undetected", "stalled", "wrong_answers")
    by_path: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(keys, 0))
    layers: dict[str, set] = defaultdict(set)
    for row in outcomes(rows):
        counts = by_path[row["path"]]
        counts["injected"] += 1
        counts["detected"] += 1 if row["detected"] else 0
        counts["undetected"] += 0 if row["detected"] or row["stalled"] else 1
        counts["stalled"] += 1 if row["stalled"] else 0
        counts["wrong_answers"] += 1 if row["exact"] is False else 0
        layers[row["path"]].update(row.get("layers") or [])
    print(f"{'path':<12}{'injected':>10}{'detected':>10}{'undetected':>12}{'stalled':>9}{'wrong answers':>15}"
          f"{'layers hit':>12}")
    result: dict[str, float] = {}
    for path, counts in sorted(by_path.items()):
        print(f"{path:<12}{counts['injected']:>10}{counts['detected']:>10}{counts['undetected']:>12}"
              f"{counts['stalled']:>9}{counts['wrong_answers']:>15}{len(layers[path]) or '-':>12}")
        result.update({f"{path}_{k}": v for k, v in counts.items()})
    injected = sum(c["injected"] for c in by_path.values())
    result["detected_share"] = round(sum(c["detected"] for c in by_path.values()) / injected, 4) if injected else 0.0
    result["tests_rc"] = rc
    print(json.dumps(result))


if __name__ == "__main__":
    main()
