"""Issue 27's measure "injected corruptions detected, by path": each fault case of test_kv_integrity.py,
test_store_vllm.py and test_fault_placements.py writes rows to a JSON-lines file when ``$PDSERVE_CORRUPTION_TALLY``
names one; ``benchmarks/corruption_tally.py`` runs those tests and prints the count per path. Without the variable
nothing is written.

A case writes its ``injected`` row before it injects (:func:`injected`) and its outcome after
(:meth:`Injection.done`), so a case that stalls, times out or dies in between still counts: as injected and not
detected (issue 41: the tally had written a row only when a case returned, so a stalled case left the share at 1.0).
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any


def _write(row: dict[str, Any]) -> None:
    out = os.environ.get("PDSERVE_CORRUPTION_TALLY")
    if not out:
        return
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


class Injection:
    """One injected corruption, its ``injected`` row already written."""

    def __init__(self, path: str, case: str, **where: Any) -> None:
        self.path, self.case, self.id = path, case, uuid.uuid4().hex
        _write({"event": "injected", "id": self.id, "path": path, "case": case, **where})

    def done(self, detected: bool, exact: bool | None = None) -> None:
        """Whether it was detected, and whether the answer still equalled one worker's (None: no answer is
        computed on this path, e.g. a read checked below vLLM)."""
        _write({"event": "outcome", "id": self.id, "path": self.path, "case": self.case, "detected": bool(detected),
                "exact": None if exact is None else bool(exact)})


def injected(path: str, case: str, **where: Any) -> Injection:
    """Write the ``injected`` row of a corruption about to be injected on ``path`` (p2p, p2p_tp, late_write,
    foreign_p, pool, pool_disk); ``where``: its placement (units, layers), for the tally's spread."""
    return Injection(path, case, **where)


def record(path: str, case: str, detected: bool, exact: bool) -> None:
    """One corruption whose injection and outcome are written at once (a case that cannot stall in between)."""
    injected(path, case).done(detected, exact)
