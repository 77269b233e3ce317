"""Issue 27's measure "injected corruptions detected, by path": each fault case of test_kv_integrity.py and
test_store_vllm.py records one row (path, case, detected, exact answer) in a JSON-lines file when
``$PDSERVE_CORRUPTION_TALLY`` names one; ``benchmarks/corruption_tally.py`` runs those tests and prints the count per
path. Without the variable nothing is written."""

from __future__ import annotations

import json
import os


def record(path: str, case: str, detected: bool, exact: bool) -> None:
    """One injected corruption on ``path`` (p2p, late_write, foreign_p, pool): whether it was detected and whether
    the answer still equalled one worker's."""
    out = os.environ.get("PDSERVE_CORRUPTION_TALLY")
    if not out:
        return
    with open(out, "a") as f:
        f.write(json.dumps({"path": path, "case": case, "detected": bool(detected), "exact": bool(exact)}) + "\n")
