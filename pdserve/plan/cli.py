"""``pdserve plan``: does disaggregation pay for this model, traffic and hardware, and with how many P and D?

    pdserve plan --model llama-3-70b --hardware H200 --network efa-p5en --gpus 16 \\
        --rate 4 --lengths 0.3:12000:300,0.7:800:300 --ttft 2 --tpot 0.05
    pdserve plan --model deepseek-v3 --hardware H200 --network efa-p5en --kv-only --context 262144
    pdserve plan --model mimo-v2-flash --trace traces/conversation_trace.jsonl --rate 2 --plot goodput.png
    pdserve plan --model models/smollm2-135m-instruct --hardware this --network this --gpus 2 \\
        --calibrate http://127.0.0.1:8000 --calibration cal.json --rate 1 --lengths 2048:64
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from pdserve.conductor.cost_model import CostModel

from ..settings.errors import ConfigError, config_fault
from .cost import HardwareCostModel, Parallelism, min_parallel
from .hardware import Accelerator, Link, accelerator, link, load_catalogue
from .kvsize import ModelSpec, format_bytes, handoff_bytes, load_model
from .results import Targets
from .search import candidates, elastic_summary, evaluate, parse_clusters, rank, reason, sweep
from .simulator import HANDOFFS, SimSettings, config_kind
from .traffic import LengthMix, Request, load_trace, poisson


class PlanError(ConfigError):
    """A bad combination of options; the message says what to give instead."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve plan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    m = p.add_argument_group("model and hardware")
    m.add_argument("--model", required=True, help="preset (llama-3-70b, deepseek-v3, ...) or config.json / folder")
    m.add_argument("--hardware", default="H200", help="accelerator from the catalogue, or 'this' (measured now)")
    m.add_argument("--network", default="efa-p5en", help="link from the catalogue, or 'this' (measured loopback)")
    m.add_argument("--gpus", type=int, default=8, help="device budget (cores for --hardware this)")
    m.add_argument("--tp", type=int, default=None, help="devices per worker (default: the fewest that fit)")
    m.add_argument("--kv-dtype", default="bf16", help="KV cache dtype: bf16 or fp8")
    m.add_argument("--dp", type=int, default=1, help="data-parallel attention ranks per worker (vLLM's "
                   "--data-parallel-size): devices per worker = --tp x --dp; a MoE model's experts span all of them "
                   "(expert parallelism): --tp 1 --dp 16 is a wide-EP worker")
    m.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: every device of a MoE "
                   "worker, --tp x --dp; 1 for a dense model)")
    m.add_argument("--decode-tp", type=int, default=None,
                   help="decode workers' tensor-parallel degree when it differs from --tp (models the P -> D "
                        "transfer fan-out: each D rank reads its KV heads from the P ranks holding them)")
    m.add_argument("--calibrate", metavar="URL", help="fit the cost model to a live pdserve router / vLLM first")
    m.add_argument("--calibration", metavar="FILE", help="save (with --calibrate) or load a fitted cost model")
    m.add_argument("--profile", metavar="DIR", help="a `pdserve bench compare --out DIR` run: calibrate from each "
                   "measured run and report the planner's error against it (TTFT, TPOT, throughput), then stop")
    k = p.add_argument_group("KV report")
    k.add_argument("--context", type=int, default=None, help="context length for the KV report (default 128K)")
    k.add_argument("--batch", type=int, default=32, help="decode batch for the KV report")
    k.add_argument("--kv-only", action="store_true", help="print the KV report and stop")
    t = p.add_argument_group("traffic")
    t.add_argument("--trace", help="Mooncake-format trace (timestamp ms, input_length, output_length, hash_ids)")
    t.add_argument("--limit", type=int, default=2000, help="requests taken from the trace (default 2000)")
    t.add_argument("--time-scale", type=float, default=1.0, help="stretch trace inter-arrival times")
    t.add_argument("--length-scale", type=float, default=1.0, help="scale trace prompt and output lengths")
    t.add_argument("--rate", type=float, default=None, help="requests/s (Poisson; rescales a trace)")
    t.add_argument("--lengths", help="weight:prompt:output,... e.g. 0.25:1536:64,0.75:100:64")
    t.add_argument("--jitter", type=float, default=0.0, help="+- fraction applied to each sampled length")
    t.add_argument("--requests", type=int, default=600, help="synthetic requests (default 600)")
    t.add_argument("--shared-prefix", type=int, default=0, help="tokens every synthetic prompt shares")
    t.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("targets and search")
    s.add_argument("--ttft", type=float, default=2.0, help="TTFT target, seconds")
    s.add_argument("--tpot", type=float, default=0.1, help="TPOT target, seconds")
    s.add_argument("--policy", default="conductor", choices=["conductor", "round_robin", "least_loaded"])
    s.add_argument("--reject", action="store_true", help="let the conductor reject requests predicted to miss")
    s.add_argument("--configs", help="evaluate only these, e.g. colocated:2,elastic:2,1P1D,2P1D (elastic: every "
                                     "worker prefills or decodes per request; needs --policy conductor)")
    s.add_argument("--all-sizes", action="store_true", help="also configurations using fewer workers")
    s.add_argument("--chunk-tokens", type=int, default=8192, help="per-step token budget (max_num_batched_tokens)")
    s.add_argument("--max-seqs", type=int, default=256, help="decodes per step (max_num_seqs)")
    s.add_argument("--handoff", choices=HANDOFFS, default="layerwise",
                   help="PD's hand-off: layerwise (default; early dispatch to D and each layer's KV as P computes "
                        "it: what pdserve's connector does, from GPU memory once each layer's kernels ran, not yet "
                        "run on a GPU), early (early dispatch, the whole KV after P's prefill: layerwise_kv off), "
                        "serial (no early dispatch)")
    s.add_argument("--no-overlap", action="store_const", const="serial", dest="handoff",
                   help="the same as --handoff serial")
    s.add_argument("--top", type=int, default=5, help="candidates shown")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    o.add_argument("--plot", metavar="FILE.png", help="goodput vs rate per configuration (needs matplotlib)")
    o.add_argument("--rates", help="rates for --plot, e.g. 1,2,4,8 (default: 0.25x..2x the traffic's rate)")
    return p


# ---------------------------------------------------------------------------------------------- inputs


def _hardware(args: argparse.Namespace) -> tuple[Accelerator, Link, float, dict[str, Any]]:
    cat = load_catalogue()
    measured: dict[str, Any] = {}
    if args.hardware == "this" or args.network == "this":
        from .measure import measure_machine

        mm = measure_machine()
        measured = {"matmul_gflops": mm.matmul_flops / 1e9, "copy_gbs": mm.copy_bytes_s / 1e9,
                    "transfer_gbs": mm.transfer_bytes_s / 1e9, "cores": mm.cores,
                    "dtype": mm.dtype, "dtype_reason": mm.dtype_reason}
        # one device = one core: the measured rates are shared by the cores
        # the measured matmul rate is an achieved rate (MFU 1); decode reaches about 60% of memcpy bandwidth;
        # --calibrate replaces both with fitted times
        acc = mm.accelerator(mfu=1.0, mbu=0.6) if args.hardware == "this" else accelerator(args.hardware, cat)
        if args.hardware == "this":
            acc = Accelerator("this-core", acc.bf16_flops / mm.cores, None, acc.mem_bw / mm.cores,
                              acc.memory_bytes / mm.cores, acc.mfu, acc.mbu, acc.step_overhead_s)
        net = mm.link() if args.network == "this" else link(args.network, cat)
    else:
        acc, net = accelerator(args.hardware, cat), link(args.network, cat)
    return acc, net, cat.handoff_s, measured


def _cost(args: argparse.Namespace, spec: ModelSpec, acc: Accelerator, net: Link, handoff_s: float
          ) -> tuple[CostModel, Parallelism, int]:
    if (args.dp > 1 or args.ep) and not args.tp:
        raise PlanError("--dp and --ep need --tp (1 for a wide-EP worker of data-parallel attention ranks)")
    par = Parallelism.of(args.tp, args.dp, spec.is_moe, args.ep) if args.tp else min_parallel(spec, acc, net,
                                                                                               args.kv_dtype)
    decode_par = Parallelism.of(args.decode_tp, 1, spec.is_moe) if args.decode_tp else None
    if decode_par is not None and not args.tp:
        raise PlanError("--decode-tp needs --tp (the prefill workers' degree) to model the transfer fan-out")
    hw = HardwareCostModel(spec, acc, net, par, args.kv_dtype, handoff_s, decode_parallel=decode_par)
    if not hw.fits():
        raise PlanError(f"{spec.name} weights do not fit on {par.devices} x {acc.name}: raise --tp")
    capacity = hw.kv_capacity_tokens()
    if args.calibrate or args.calibration:
        from .calibrate import Calibration, calibrate

        if args.calibrate:
            cal = calibrate(args.calibrate, hw.kv_bytes_per_token, net.effective_bytes_s(par.devices),
                            handoff_s)
            if args.calibration:
                cal.save(args.calibration)
        else:
            cal = Calibration.load(args.calibration)
        return cal.cost_model(), par, capacity
    return hw, par, capacity


def _traffic(args: argparse.Namespace, rate: float | None = None) -> list[Request]:
    rate = rate if rate is not None else args.rate
    if args.trace:
        return load_trace(args.trace, time_scale=args.time_scale, length_scale=args.length_scale, rate=rate,
                          limit=args.limit)
    if not args.lengths or rate is None:
        raise PlanError("give traffic: --trace FILE [--rate R], or --rate R --lengths weight:prompt:output,...")
    return poisson(rate, args.requests, LengthMix.parse(args.lengths, args.jitter), seed=args.seed,
                   shared_prefix_tokens=args.shared_prefix)


def _kv_report(spec: ModelSpec, cost: CostModel, context: int, batch: int, kv_dtype: str) -> dict[str, Any]:
    per_req = spec.kv_bytes(context, kv_dtype)
    return {"model": spec.name, "kv_dtype": kv_dtype, "context": context, "batch": batch,
            "kv_bytes_per_token": spec.kv_bytes_per_token(kv_dtype),
            "kv_bytes_per_token_long": spec.kv_bytes_per_token_long(kv_dtype),
            "kv_bytes_request": per_req, "kv_bytes_batch": spec.kv_bytes_batch([context] * batch, kv_dtype),
            "handoff_bytes": handoff_bytes(spec, context, kv_dtype),
            "transfer_s": cost.transfer_s(int(per_req)),
            "weights_bytes": spec.weight_bytes(), "total_params": spec.total_params,
            "active_params": spec.active_params}


# ---------------------------------------------------------------------------------------------- output


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}" if v < 0.1 else f"{v * 1e3:.0f}"


def _print_kv(kv: dict[str, Any], devices: int, hardware: str, network: str) -> None:
    print(f"{kv['model']}: {kv['total_params'] / 1e9:.1f}B params ({kv['active_params'] / 1e9:.1f}B active), "
          f"weights {format_bytes(kv['weights_bytes'])}; worker = {devices} x {hardware}, link {network}")
    print(f"  KV {kv['kv_dtype']}: {format_bytes(kv['kv_bytes_per_token'])}/token"
          + (f" ({format_bytes(kv['kv_bytes_per_token_long'])}/token beyond the window)"
             if kv["kv_bytes_per_token_long"] != kv["kv_bytes_per_token"] else "")
          + f"; one request at {kv['context']} tokens: {format_bytes(kv['kv_bytes_request'])} "
          f"({kv['kv_bytes_request'] / 1e9:.2f} GB), transfer {kv['transfer_s'] * 1e3:.0f} ms, hand-off "
          f"{format_bytes(kv['handoff_bytes'])} (vLLM's blocks, hybrid KV cache manager on); "
          f"batch of {kv['batch']}: {format_bytes(kv['kv_bytes_batch'])}")


def _print_table(ranked: Sequence[dict[str, Any]], targets: Targets, top: int) -> None:
    cols = ["config", "devices", "goodput/s", "SLO %", "TTFT p50", "TTFT p99", "TPOT p50", "gap p50", "gap p99",
            "TPOT p99", "ITL p99", "util P/D or C/E", "local/PD/rej"]
    rows = []
    shown = list(ranked[:top])
    for kind in ("colocated", "elastic", "pd"):  # the best of each shape is always listed
        best = next((r for r in ranked if config_kind(r["config"]) == kind), None)
        if best is not None and best not in shown:
            shown.append(best)
    for r in shown:
        u = r["utilization"]
        util = "/".join(f"{u[k]:.0%}" for k in ("prefill", "decode", "colocated", "elastic") if k in u)
        d = r["decisions"]
        rows.append([r["config"], str(r["devices"]), f"{r['goodput_rps']:.2f}", f"{r['slo_attainment']:.0%}",
                     _ms(r["ttft_s"]["p50"]), _ms(r["ttft_s"]["p99"]), _ms(r["tpot_s"]["p50"]),
                     _ms(r["handoff_gap_s"]["p50"]), _ms(r["handoff_gap_s"]["p99"]), _ms(r["tpot_s"]["p99"]),
                     _ms(r["itl_s"]["p99"]), util,
                     f"{d['local']}/{d['disaggregated']}/{d['reject']}"])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print(f"targets: TTFT <= {targets.ttft_s * 1e3:.0f} ms, TPOT <= {targets.tpot_s * 1e3:.0f} ms; times in ms")
    for row in [cols, *rows]:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _plot(path: str, curves: dict[str, list[tuple[float, float]]], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanError("--plot needs matplotlib: .venv/bin/python -m pip install -c scripts/constraints.txt "
                        "matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    lim = max(p[0] for pts in curves.values() for p in pts)
    ax.plot([0, lim], [0, lim], color="grey", linestyle=":", label="offered")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting TTFT and TPOT targets)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = load_model(args.model)
    acc, net, handoff_s, measured = _hardware(args)
    cost, par, capacity = _cost(args, spec, acc, net, handoff_s)
    out: dict[str, Any] = {"hardware": acc.name, "network": net.name, "devices_per_worker": par.devices,
                           "parallelism": {"tp": par.tp, "dp": par.dp, "ep": par.ep},
                           "kv_capacity_tokens_per_worker": capacity}
    if measured:
        out["measured"] = measured
    context = args.context or 128 * 1024
    out["kv"] = _kv_report(spec, cost, context, args.batch, args.kv_dtype)
    fan = cost.fanout() if isinstance(cost, HardwareCostModel) else None
    if fan is not None:
        out["kv"]["fanout"] = fan.report(out["kv"]["kv_bytes_request"], net)
    if args.kv_only:
        return out
    if args.profile:
        from .profile import validate

        kv = int(spec.kv_bytes_per_token(args.kv_dtype))
        out["profile"] = {"folder": args.profile,
                          "runs": validate(args.profile, kv, net.effective_bytes_s(par.devices))}
        return out
    requests = _traffic(args)
    targets = Targets(args.ttft, args.tpot)
    settings = SimSettings(targets, policy=args.policy, chunk_tokens=args.chunk_tokens, max_seqs=args.max_seqs,
                           kv_capacity_tokens=capacity, reject=args.reject, handoff=args.handoff)
    clusters = (parse_clusters(args.configs, par.devices) if args.configs
                else candidates(args.gpus, par.devices, args.all_sizes, elastic=args.policy == "conductor"))
    ranked = rank(evaluate(clusters, cost, settings, requests))
    elastic = elastic_summary(ranked)
    if elastic is not None:
        out["elastic"] = elastic
    out.update(recommended=ranked[0]["config"], reason=reason(ranked, requests), candidates=ranked,
               traffic={"requests": len(requests), "rate": ranked[0]["offered_rate"],
                        "mean_prompt": sum(r.prompt_tokens for r in requests) / len(requests),
                        "mean_output": sum(r.output_tokens for r in requests) / len(requests)})
    if args.plot:
        base = ranked[0]["offered_rate"] or 1.0
        rates = ([float(x) for x in args.rates.split(",")] if args.rates
                 else [round(base * f, 3) for f in (0.25, 0.5, 1.0, 1.5, 2.0)])
        keep = [c for c in clusters if c.label in {r["config"] for r in ranked[: max(args.top, 2)]}]
        out["sweep"] = sweep(keep, cost, settings, lambda r: _traffic(args, r), rates)
        _plot(args.plot, out["sweep"], f"{spec.name} on {acc.name} ({args.gpus} devices)")
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except ConfigError as exc:
        return config_fault("pdserve plan", exc)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, default=float))
        return 0
    _print_kv(out["kv"], out["devices_per_worker"], out["hardware"], out["network"])
    if "fanout" in out["kv"]:
        f = out["kv"]["fanout"]
        print(f"  P tp={f['p_tp']} -> D tp={f['d_tp']} ({f['kv_heads']} KV heads): {f['flows']} rank-to-rank reads, "
              f"each D rank from {f['p_ranks_per_d_rank']} P rank(s), "
              f"{'head slices' if f['strided'] else 'whole blocks'}; busiest rank moves "
              f"{format_bytes(f['busiest_rank_bytes'])}, transfer {f['transfer_s'] * 1e3:.0f} ms")
    if "profile" in out:
        from .profile import table

        print(f"the planner against the measured runs of {out['profile']['folder']} (calibrated from each run's own "
              "requests; times in ms, error = (simulated - measured) / measured):")
        print("\n".join(table(out["profile"]["runs"])))
    if "candidates" in out:
        t = out["traffic"]
        print(f"traffic: {t['requests']} requests at {t['rate']:.2f} req/s, mean prompt {t['mean_prompt']:.0f}, "
              f"mean output {t['mean_output']:.0f} tokens")
        _print_table(out["candidates"], Targets(args.ttft, args.tpot), args.top)
        print(f"recommended: {out['recommended']} -- {out['reason']}")
        if "elastic" in out and not out["recommended"].startswith("elastic"):
            print(f"elastic roles: {out['elastic']}")
        if args.plot:
            print(f"plot: {args.plot}")
    return 0

