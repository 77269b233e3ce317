"""AIPerf's Mooncake trace replay against a live pdserve router: the interop check of docs/bench.md.

    python benchmarks/bench_aiperf.py [--aiperf PATH] [--model DIR] [--requests N] [--rate R]

Starts a 1P1D cluster (default: a small random-weight Llama, SmolLM2 tokenizer), writes the scaled conversation
trace with ``pdserve bench trace --export``, replays it with ``aiperf profile --custom-dataset-type mooncake_trace
--fixed-schedule`` against the router, then replays the same scaled trace with ``pdserve bench run`` on the same
cluster, and prints both tools' TTFT/ITL medians side by side (a table and a final JSON line).
AIPerf lives in its own venv (``python -m venv /tmp/pd/aiperf-venv && /tmp/pd/aiperf-venv/bin/pip install aiperf``;
it does not pull torch).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pdserve.bench import cli as bench_cli  # noqa: E402
from pdserve.bench.compare import CompareSettings, launcher_config  # noqa: E402
from pdserve.launch import Cluster  # noqa: E402


def aiperf_metric(artifacts: Path, name: str) -> float | None:
    """p50 (else avg) of one metric from AIPerf's profile_export_aiperf.json (ms; counts have only avg)."""
    files = glob.glob(str(artifacts / "**" / "profile_export_aiperf.json"), recursive=True)
    if not files:
        return None
    data = json.loads(Path(files[0]).read_text())
    m = data.get(name) or data.get("records", {}).get(name) or {}
    if not isinstance(m, dict):
        return None
    return m.get("p50", m.get("avg"))


def hf_cache_entry(model_dir: Path, root: Path, repo: str = "pdserve/tokenizer") -> str:
    """Lay the model folder's tokenizer out as a Hugging Face cache entry under ``root`` (use as HF_HOME) and
    return the repo id to pass as ``--tokenizer``: AIPerf 0.13 takes a local folder for a Hub repo id and fails
    offline, but resolves a cached repo with HF_HUB_OFFLINE=1."""
    import shutil

    rev = "0" * 40
    entry = root / "hub" / ("models--" + repo.replace("/", "--"))
    snap = entry / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("config.json", "special_tokens_map.json",
                                                                         "chat_template.jinja",
                                                                         "generation_config.json")):
            shutil.copy(f, snap / f.name)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(rev)
    return repo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aiperf", default="/tmp/pd/aiperf-venv/bin/aiperf")
    ap.add_argument("--model", default="", help="model folder (default: a random-weight Llama built once)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--input-scale", type=float, default=0.05)
    args = ap.parse_args()
    if not Path(args.aiperf).exists():
        print(f"aiperf not found at {args.aiperf}: python -m venv /tmp/pd/aiperf-venv && "
              "/tmp/pd/aiperf-venv/bin/pip install aiperf", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="pdserve-aiperf-"))
    model = args.model
    if not model:
        from pdserve.launch.models import build_random_llama

        model = str(build_random_llama(work / "random-llama"))
    spec = (f"trace:input_scale={args.input_scale},output_scale=0.05,max_output=16,requests={args.requests},"
            f"rate={args.rate}")
    trace = work / "trace.jsonl"
    if bench_cli.main(["trace", "--workload", spec, "--max-model-len", "2048", "--export", str(trace)]):
        return 2
    block = max(1, round(512 * args.input_scale))
    settings = CompareSettings(model=model, dtype="float32" if not args.model else None, max_model_len=2048,
                               run_dir=str(work / "run"))
    out: dict = {}
    with Cluster(launcher_config("1p1d", settings), log=lambda s: print(f"[cluster] {s}", file=sys.stderr)) as c:
        cmd = [args.aiperf, "profile", "--model", c.model_name, "--url", c.router_url, "--endpoint-type",
               "completions", "--streaming", "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
               "--fixed-schedule", "--fixed-schedule-auto-offset", "--isl-block-size", str(block),
               "--tokenizer", hf_cache_entry(c.model_dir, work / "hf"), "--extra-inputs", "ignore_eos:true",
               "--ui-type", "none",
               "--artifact-dir", str(work / "aiperf")]
        print("$ " + " ".join(cmd), file=sys.stderr)
        t0 = time.monotonic()
        env = dict(os.environ, HF_HOME=str(work / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        out["aiperf_rc"] = proc.returncode
        out["aiperf_wall_s"] = round(time.monotonic() - t0, 1)
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        out["aiperf_ttft_p50_ms"] = aiperf_metric(work / "aiperf", "time_to_first_token")
        out["aiperf_itl_p50_ms"] = aiperf_metric(work / "aiperf", "inter_token_latency")
        out["aiperf_requests"] = aiperf_metric(work / "aiperf", "request_count")
        rc = bench_cli.main(["run", "--url", c.router_url, "--vocab-size", "49152", "--no-progress", "--workload",
                             spec.replace("trace:", "trace:seed=1,name=pdserve,"), "--out", str(work / "pdserve")])
        if rc:
            return rc
        rows = json.loads((work / "pdserve" / "results.json").read_text())["workloads"]["pdserve"]
        out["pdserve_ttft_p50_ms"] = rows["ttft_p50_ms"]
        out["pdserve_itl_p50_ms"] = rows["itl_p50_ms"]
        out["pdserve_tpot_p50_ms"] = rows["tpot_p50_ms"]  # AIPerf's inter_token_latency is per request, like TPOT
        out["pdserve_requests"] = rows["requests"]
    out["artifacts"] = str(work)
    print(f"{'tool':<10}{'TTFT p50 ms':>14}{'ITL p50 ms':>14}")
    print(f"{'aiperf':<10}{str(out['aiperf_ttft_p50_ms']):>14}{str(out['aiperf_itl_p50_ms']):>14}")
    print(f"{'pdserve':<10}{str(out['pdserve_ttft_p50_ms']):>14}{str(out['pdserve_itl_p50_ms']):>14}")
    print(json.dumps(out))
    return 0 if out["aiperf_rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
