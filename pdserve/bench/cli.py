"""``pdserve bench``: run a workload against a URL, compare serving configurations, or inspect a scaled trace.

    pdserve bench run --url http://127.0.0.1:8000 --workload 'poisson:rate=2,input=256,output=32,requests=40'
    pdserve bench compare --configs colocated2,1p1d --workload 'trace:input_scale=0.1,output_scale=0.1' \\
        --rates 0.3,0.6 --slo-ttft-ms 2000 --slo-tpot-ms 100 --out bench-out/
    pdserve bench trace --workload 'trace:input_scale=0.1,rate=1,requests=60'
    pdserve bench report bench-out/ --slo-ttft-ms 5000 --slo-tpot-ms 100 --out bench-out-5s/

Workload specs: ``trace:`` (Mooncake JSONL; path, start, requests, input_scale, output_scale, time_scale, rate,
max_input, max_output, seed, concurrency), ``poisson:`` / ``fixed:`` (rate, requests, input, output, input_dist,
output_dist in fixed|uniform|exp|lognormal, seed, concurrency), ``agent:`` (sessions, turns, rate, system, user,
tool, output, think_s, seed, concurrency). ``concurrency=N`` makes any of them closed loop. Every command prints a
table and a final JSON line; ``--out DIR`` keeps results.json, per-request records and (compare) report.md + PNGs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import urllib.request
from pathlib import Path
from typing import Any

from ..launch.config import ConfigError
from ..settings.errors import config_fault
from .metrics import SLO, phase_summary, summarize
from .traces import TraceError


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: give comma-separated numbers, e.g. 0.5,1,2") from None


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", action="append", required=True,
                   help="workload spec KIND[:key=value,...]; repeat for several (compare runs each in turn)")
    p.add_argument("--rates", type=_floats, default=None, help="comma-separated rates: run every workload at each")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput target for TTFT (ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput target for TPOT (ms)")
    p.add_argument("--max-requests", type=int, default=None, help="send at most this many requests per workload")
    p.add_argument("--duration-s", type=float, default=None,
                   help="stop sending after this many seconds per workload (in-flight requests get --drain-s more)")
    p.add_argument("--drain-s", type=float, default=120.0, help="grace for in-flight requests after --duration-s")
    p.add_argument("--no-timings", action="store_true", help="do not ask for the router's pdserve_timings")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--out", default="", help="folder for results.json, raw records, report (default: none)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run workloads against one OpenAI-compatible URL")
    r.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (router or plain vLLM)")
    r.add_argument("--model", default="", help="model name (default: the first one /v1/models lists)")
    r.add_argument("--vocab-size", type=int, default=32000,
                   help="token ids are drawn below this (default 32000; use the tokenizer's size)")
    r.add_argument("--max-model-len", type=int, default=None,
                   help="cap prompt+output to this (default: /v1/models' max_model_len, if the server says)")
    _add_common(r)
    c = sub.add_parser("compare", help="start each configuration in turn and run the same workloads on it")
    c.add_argument("--configs", default="colocated2,1p1d",
                   help="comma-separated: colocatedN, PpDd, PpDd-POLICY (default colocated2,1p1d)")
    c.add_argument("--model", default="", help="model folder (default: SmolLM2-135M-Instruct, converted once)")
    c.add_argument("--max-model-len", type=int, default=4096)
    c.add_argument("--kv-cache-gib", type=int, default=1)
    c.add_argument("--max-num-batched-tokens", type=int, default=None)
    c.add_argument("--dtype", default=None)
    c.add_argument("--cores", default="", help="CPU ids to use, e.g. 0,1 (default: all this process may use)")
    c.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    _add_common(c)
    rp = sub.add_parser("report", help="re-score a finished comparison at other goodput targets (new report)")
    rp.add_argument("src", help="the --out folder of a finished compare")
    rp.add_argument("--slo-ttft-ms", type=float, default=None)
    rp.add_argument("--slo-tpot-ms", type=float, default=None)
    rp.add_argument("--out", required=True, help="folder for the new report")
    t = sub.add_parser("trace", help="build a workload and print what it holds (no server needed)")
    t.add_argument("--workload", action="append", required=True)
    t.add_argument("--vocab-size", type=int, default=32000)
    t.add_argument("--max-model-len", type=int, default=None)
    t.add_argument("--export", default="", help="write the (first) scaled trace workload as Mooncake JSONL here, "
                   "e.g. for AIPerf's mooncake_trace replay")
    return ap


def _server_info(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            data = json.loads(resp.read())["data"]
        return data[0] if data else {}
    except (OSError, KeyError, ValueError, IndexError) as exc:
        raise ConfigError(f"{url}/v1/models did not answer ({exc}): is the server up? pass --url") from None


def _slo(args: argparse.Namespace) -> SLO:
    return SLO(args.slo_ttft_ms, args.slo_tpot_ms)


def _run_opts(args: argparse.Namespace) -> dict[str, Any]:
    return dict(timings=not args.no_timings, max_requests=args.max_requests, duration_s=args.duration_s,
                drain_s=args.drain_s, progress=not args.no_progress)


def print_table(rows: dict[str, dict[str, Any]], cols: tuple[str, ...]) -> None:
    width = max([len(k) for k in rows] + [8]) + 2
    heads = [c.replace("_ms", "").replace("_req_per_s", "").replace("handoff_gap", "gap") for c in cols]
    print(f"{'':<{width}}" + "".join(f"{h:>12}" for h in heads))
    for name, row in rows.items():
        print(f"{name:<{width}}" + "".join(f"{'-' if row.get(c) is None else row[c]:>12}" for c in cols))


COLS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "handoff_gap_p50_ms", "handoff_gap_p99_ms", "tpot_p99_ms",
        "itl_p99_ms", "e2e_p50_ms", "req_per_s", "goodput_req_per_s", "errors")


def cmd_run(args: argparse.Namespace) -> int:
    from .compare import plan_workloads
    from .runner import RunOptions, run
    from .workload import build_workload

    info = _server_info(args.url)
    model = args.model or info.get("id", "")
    max_len = args.max_model_len or info.get("max_model_len")
    out = Path(args.out) if args.out else None
    rows: dict[str, dict[str, Any]] = {}
    for plan in plan_workloads(args.workload, args.rates):
        wl = build_workload(plan.spec, vocab_size=args.vocab_size, max_model_len=max_len, overrides=plan.overrides)
        wl.name = plan.label
        result = run(wl, RunOptions(url=args.url, model=model, **_run_opts(args)))
        row = summarize(result.records, result.wall_s, _slo(args))
        row.update(phase_summary(result.records))
        row["offered_rate"] = wl.offered_rate
        row["truncated"] = result.truncated
        rows[plan.label] = row
        if out:
            (out / "raw").mkdir(parents=True, exist_ok=True)
            from .report import slug

            (out / "raw" / f"run__{slug(plan.label)}.json").write_text(json.dumps(result.to_dict()))
    if out:
        (out / "results.json").write_text(json.dumps({"url": args.url, "model": model, "workloads": rows}, indent=1))
    print_table(rows, COLS)
    print(json.dumps({"url": args.url, "model": model, "workloads": rows}))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .compare import CompareSettings, compare, plan_workloads
    from .report import write_report

    cores = tuple(int(c) for c in args.cores.split(",") if c.strip()) if args.cores else ()
    out = Path(args.out or "bench-out")
    settings = CompareSettings(model=args.model, max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
                               max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype, cores=cores,
                               run_dir=str(out / "runs"))
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    plans = plan_workloads(args.workload, args.rates)
    results = compare(configs, plans, settings, _slo(args), out, _run_opts(args))
    command = "pdserve bench " + " ".join(shlex.quote(a) for a in args.argv)
    summary = write_report(results, out, command=command, plots=not args.no_plots)
    done = [c for c in results["order"] if c in results["configs"]]  # a configuration that failed has no rows
    for name, why in results.get("failed", {}).items():
        print(f"{name}: failed: {why}")
    for label in results["workloads"]:
        print(f"== {label}")
        print_table({c: results["configs"][c]["workloads"][label] for c in done}, COLS)
    for v in summary["verdicts"]:
        print(f"{v['workload']}: {v['winner']} wins" + (f" (goodput {v.get('goodput_ratio')}x, TPOT p99 "
              f"{v.get('tpot_p99_ratio')}x, TTFT p50 {v.get('ttft_p50_ratio')}x vs {v['runner_up']})"
              if v.get("runner_up") else ""))
    print(f"report: {out / 'report.md'}", file=sys.stderr)
    flat: dict[str, Any] = {"report": str(out / "report.md")}
    for c in done:
        for label, row in results["configs"][c]["workloads"].items():
            for k in COLS + ("handoff_gap_over_tpot_p50", "transfer_share_p50", "kv_read_share_of_ttft_p50",
                             "offered_rate", "handoff_p50_ms",
                             "handoff_p99_ms", "kv_bytes_per_request", "prefill_tokens_computed",
                             "prefix_cache_tokens", "pool_hit_tokens", "pool_get_gbps", "pool_put_gbps"):
                flat[f"{c}|{label}|{k}"] = row.get(k)
    flat["verdicts"] = summary["verdicts"]
    flat["crossovers"] = summary["crossovers"]
    print(json.dumps(flat, default=str))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from .compare import plan_workloads
    from .traces import TraceScale, export_mooncake, load_trace, scale_rows
    from .workload import build_workload

    rows = {}
    exported = False
    for plan in plan_workloads(args.workload, None):
        wl = build_workload(plan.spec, vocab_size=args.vocab_size, max_model_len=args.max_model_len,
                            overrides=plan.overrides)
        rows[plan.label] = {k: v for k, v in wl.info.items() if not isinstance(v, dict)}
        rows[plan.label]["offered_rate"] = wl.offered_rate
        if args.export and not exported and wl.info.get("kind") == "trace":
            info = wl.info
            scaled = scale_rows(load_trace(info["path"], info["start"], info["requests"]), TraceScale(**info["scale"]))
            export_mooncake(scaled, info["block_tokens"], args.export)
            rows[plan.label]["exported"] = args.export
            rows[plan.label]["aiperf_isl_block_size"] = info["block_tokens"]
            exported = True
    if args.export and not exported:
        raise TraceError("--export needs a trace: workload (the others are not Mooncake traces)")
    for label, row in rows.items():
        print(label)
        for k, v in row.items():
            print(f"  {k:<14}{v}")
    print(json.dumps(rows, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "report":
            from .report import rescore

            summary = rescore(Path(args.src), Path(args.out), args.slo_ttft_ms, args.slo_tpot_ms)
            for v in summary["verdicts"]:
                print(f"{v['workload']}: {v['winner']} wins (goodput {v.get('goodput_ratio')}x vs "
                      f"{v.get('runner_up')})")
            print(json.dumps(summary, default=str))
            return 0
        return cmd_trace(args)
    except ConfigError as exc:
        return config_fault("pdserve bench", exc)
    except TraceError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
