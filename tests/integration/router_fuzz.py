"""schemathesis against a router with real vLLM workers (issue 42): the router's own /openapi.json, the checks
``not_a_server_error`` and ``status_code_conformance``, no hooks (no case dropped), a fixed seed and a time budget;
the cases generated and the server errors per operation are read back from schemathesis' NDJSON report."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

CHECKS = "not_a_server_error,status_code_conformance"
# the six doors that take a body; the admin operations change the stack other tests share
OPERATIONS = ("completion", "chatCompletion", "messages", "responses", "tokenize", "detokenize")
SEED = 42


@dataclass
class Row:
    cases: int = 0
    server_errors: int = 0
    failed: Counter = field(default_factory=Counter)  # check name -> failures
    seconds: float = 0.0


@dataclass
class Run:
    rc: int
    output: str
    rows: dict[str, Row]

    @property
    def cases(self) -> int:
        return sum(r.cases for r in self.rows.values())

    @property
    def server_errors(self) -> int:
        return sum(r.server_errors for r in self.rows.values())


def schemathesis(router_url: str, out_dir: Path, phases: str, max_examples: int, max_time_s: int,
                 operations: tuple[str, ...] = OPERATIONS, seed: int = SEED, split: bool = False) -> Run:
    """schemathesis over ``operations`` (operationIds) within ``max_time_s``: one run (the operations in the
    document's order, as far as the budget reaches), or with ``split`` one run per operation, each within its
    share, so that one whose cases generate long answers (/v1/responses) leaves the others their time. One
    schemathesis worker per run: two threads hit a hypothesis race here (``SystemError: AST constructor recursion
    depth mismatch``). ``rc``: the first failed run's, else 0."""
    if not split:
        return _one(router_url, out_dir, phases, max_examples, max_time_s, operations, seed)
    share = max(1, max_time_s // len(operations))
    runs = [_one(router_url, out_dir / op, phases, max_examples, share, (op,), seed) for op in operations]
    return Run(next((r.rc for r in runs if r.rc), 0), "\n".join(r.output for r in runs),
               {label: row for r in runs for label, row in r.rows.items()})


def _one(router_url: str, out_dir: Path, phases: str, max_examples: int, max_time_s: int,
         operations: tuple[str, ...], seed: int) -> Run:
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert exe is not None, "schemathesis is a dev dependency (pyproject.toml)"
    out_dir.mkdir(parents=True, exist_ok=True)
    ndjson = out_dir / "report.ndjson"
    cmd = [exe, "run", router_url + "/openapi.json", "--checks", CHECKS, "--phases", phases,
           "--max-examples", str(max_examples), "--seed", str(seed), "--max-time", str(max_time_s),
           "--workers", "1", "--request-timeout", "120", "--no-color", "--report", "ndjson",
           "--report-ndjson-path", str(ndjson)]
    for op in operations:
        cmd += ["--include-operation-id", op]
    proc = subprocess.run(cmd, cwd=out_dir, capture_output=True, text=True, timeout=max_time_s + 300)
    output = proc.stdout + proc.stderr
    (out_dir / "schemathesis.txt").write_text(output)
    return Run(proc.returncode, output, tally(ndjson) if ndjson.exists() else {})


def tally(ndjson: Path) -> dict[str, Row]:
    """Per operation ("POST /v1/completions"): the cases generated, the answers with a 5xx, the failed checks."""
    rows: dict[str, Row] = {}
    for line in ndjson.read_text().splitlines():
        event = json.loads(line).get("ScenarioFinished")
        if event is None:
            continue
        rec = event["recorder"]
        row = rows.setdefault(rec["label"], Row())
        row.cases += len(rec.get("cases", {}))
        row.seconds += event.get("elapsed_time") or 0.0
        for it in rec.get("interactions", {}).values():
            if ((it.get("response") or {}).get("status_code") or 0) >= 500:
                row.server_errors += 1
        for checks in rec.get("checks", {}).values():
            row.failed.update(c["name"] for c in checks if c["status"] == "failure")
    return rows


def table(run: Run) -> str:
    lines = ["| operation | cases | server errors | failed checks | s |", "|---|---|---|---|---|"]
    for label, r in sorted(run.rows.items()):
        lines.append(f"| {label} | {r.cases} | {r.server_errors} | {dict(r.failed) or '-'} | {r.seconds:.1f} |")
    lines.append(f"| all | {run.cases} | {run.server_errors} | | |")
    return "\n".join(lines)
