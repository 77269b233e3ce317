"""``pdserve`` command line.

    pdserve serve                                   # 1 prefill + 1 decode worker, router on 127.0.0.1:8000
    pdserve serve --prefill 1 --decode 1 --model DIR --port 8000
    pdserve serve --colocated 1 --cores-per-worker 2  # the baseline: one plain worker on both cores
    pdserve serve --elastic 2                         # two workers, each request colocated or split P -> D
    pdserve serve --config deploy/pdserve.example.yaml --port 9000   # flags override the file
    pdserve serve --dry-run                         # print the commands, start nothing
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .launch.config import ConfigError, LauncherConfig, parse_cpu_list
from .launch.procs import LaunchError
from .settings.errors import config_fault
from .settings.flags import add_flags, non_negative_int


class _Stop(BaseException):
    """Raised in the main thread by the SIGTERM/SIGHUP handler (like KeyboardInterrupt for SIGINT)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill-decode disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="start vLLM workers and the router on this machine",
        description="Start vLLM workers (pinned cores, free ports) and the pdserve router; Ctrl-C stops all.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    for name, (_, text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    d = argparse.SUPPRESS  # only flags actually given override the config file
    s.add_argument("--config", metavar="FILE", help="YAML file of settings (see deploy/pdserve.example.yaml)")
    add_flags(s, "launcher", suppress=True, int_type=non_negative_int)  # every simple setting, from the table
    s.add_argument("--cores", default=d, metavar="LIST",
                   help="CPU ids to spread workers over, e.g. 0,1 or 0-3 (default: all this process may use)")
    s.add_argument("--worker-args", default=d, metavar="'ARGS'",
                   help="extra vLLM flags for every worker, e.g. '--max-num-seqs 8' (a lone flag: --worker-args=--x)")
    s.add_argument("--prefill-args", default=d, metavar="'ARGS'", help="extra vLLM flags for prefill workers")
    s.add_argument("--decode-args", default=d, metavar="'ARGS'", help="extra vLLM flags for decode workers")
    s.add_argument("--router-args", default=d, metavar="'ARGS'", help="extra flags for python -m pdserve.router")
    s.add_argument("--gpus", default=d, metavar="LIST",
                   help="GPU ids the workers may use, e.g. 0,1 (default auto: $CUDA_VISIBLE_DEVICES, else "
                        "`nvidia-smi -L`; none: CPU workers even on a GPU host)")
    s.add_argument("--dry-run", action="store_true", help="print the plan (commands, ports, cores) and exit")
    s.add_argument("--quiet", action="store_true", help="print only errors and the usage banner")
    return parser


def config_from_args(args: argparse.Namespace, discover: Callable[[], tuple[str, ...]] | None = None
                     ) -> LauncherConfig:
    """The launch's config from flags (and --config); ``discover``: how to find GPUs (default: nvidia-smi)."""
    overrides: dict[str, Any] = {}
    skip = {"command", "config", "dry_run", "quiet"}
    for key, value in vars(args).items():
        if key in skip:
            continue
        if key in ("worker_args", "prefill_args", "decode_args", "router_args"):
            value = tuple(shlex.split(value))
        elif key == "cores":
            value = parse_cpu_list(value)
        elif key == "gpus" and str(value).strip().lower() == "auto":
            continue  # discovery below
        overrides[key] = value
    if _elastic_asked(args.config, overrides) and "policy" not in overrides and not _file_sets(args.config,
                                                                                            "policy"):
        overrides["policy"] = "conductor"  # elastic roles are the conductor's choice per request (before the
        # config is built, so that an SLO target given with --elastic finds the policy it needs)
    if args.config:
        config = LauncherConfig.from_yaml(args.config, **overrides)
    else:
        config = LauncherConfig.from_mapping(overrides, source="flags")
    return with_discovered_gpus(config, args, discover)


def _elastic_asked(path: str | None, overrides: dict[str, Any]) -> bool:
    """The launch runs elastic workers: ``--elastic N``, or the file's ``elastic`` unless fixed-role flags
    replace it (as :meth:`LauncherConfig.from_yaml` merges them)."""
    if "elastic" in overrides:
        return bool(overrides["elastic"])
    if "prefill" in overrides or "decode" in overrides or overrides.get("colocated"):
        return False
    return _file_sets(path, "elastic", unless="0")


def _file_sets(path: str | None, key: str, unless: str | None = None) -> bool:
    """The YAML file at ``path`` names ``key`` (with a value other than ``unless``, compared case-blind)."""
    if not path:
        return False
    try:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, ValueError, ImportError):
        return False
    if not isinstance(data, dict) or key not in data:
        return False
    return unless is None or str(data[key]).strip().lower() != unless


def with_discovered_gpus(config: LauncherConfig, args: argparse.Namespace,
                         discover: Callable[[], tuple[str, ...]] | None = None) -> LauncherConfig:
    """``gpus`` from discovery unless ``--gpus`` or the config file named them (``auto`` asks for discovery);
    no GPU found keeps the CPU plan as it was."""
    given = getattr(args, "gpus", None)
    from_file = _file_sets(getattr(args, "config", None), "gpus", unless="auto")
    if (given is not None and given.strip().lower() != "auto") or (given is None and from_file):
        return config
    if discover is None:
        from .launch.gpus import discover_gpus

        discover = discover_gpus
    found = discover()
    return config.with_overrides(gpus=found) if found else config




def describe_devices(config: LauncherConfig, plan: Any) -> str:
    """One line for --dry-run: the data plane and each worker's GPUs (or the CPU plan)."""
    head = f"kv connector: {config.kv_connector}"
    if not config.gpus:
        return f"{head}; gpus: none found (CPU workers)"
    parts = []
    for w in plan.workers:
        util = "" if w.gpu_memory_utilization is None else f" @{w.gpu_memory_utilization}"
        parts.append(f"{w.name} -> {','.join(w.gpus)}{util}")
    return f"{head}; gpus: {','.join(config.gpus)}: " + ", ".join(parts)


def serve(args: argparse.Namespace) -> int:
    from .launch import Cluster, make_plan, usage_text

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[pdserve] {msg}", file=sys.stderr, flush=True)

    try:
        config = config_from_args(args)
    except ConfigError as e:
        return config_fault("pdserve", e)

    if args.dry_run:  # the plan only: no model conversion, no socket (ports numbered from the base port)
        model_dir = config.model_dir.resolve() if config.model else config.model_dir
        try:
            plan = make_plan(config, model_dir)
        except ConfigError as e:  # a combination the launch refuses (e.g. pdserve/launch/plane_limits.py)
            return config_fault("pdserve", e)
        print(f"mode: {config.mode}, model: {model_dir} (served as {plan.model_name})")
        from .launch.plan import worker_dtype

        print(describe_devices(config, plan))
        from .launch.checksum_note import checksum_note

        print(checksum_note(config))
        from .launch.pool_note import pool_note

        if pool_note(config, model_dir):
            print(pool_note(config, model_dir))
        if not config.gpus:  # GPU workers keep vLLM's own dtype default unless --dtype
            print(worker_dtype(config.dtype).describe())
        print(f"{plan.describe_ports()}  (dry run: numbered from port {plan.ports.router}; a launch takes free "
              "ports, and the router's --port unless 0)")
        print(plan.describe())
        return 0

    stopping: dict[str, int | None] = {"sig": None}

    def on_signal(signum, frame):  # noqa: ARG001
        if stopping["sig"] is not None:
            say("already stopping; waiting for processes to exit")
            return
        stopping["sig"] = signum
        raise _Stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    cluster = Cluster(config, log=say)
    code = 0
    try:
        try:
            cluster.start()
            print(usage_text(cluster), flush=True)
            code = _supervise(cluster, say)
        except (_Stop, KeyboardInterrupt):
            stopping["sig"] = stopping["sig"] or signal.SIGINT
            say(f"got {signal.Signals(stopping['sig'] or signal.SIGINT).name}: stopping workers and router")
        except LaunchError as e:
            stopping["sig"] = signal.SIGTERM
            print(f"pdserve: {e}", file=sys.stderr)
            code = 1
        except ConfigError as e:
            stopping["sig"] = signal.SIGTERM
            code = config_fault("pdserve", e)
    finally:
        stopping["sig"] = stopping["sig"] or signal.SIGTERM  # later signals no longer interrupt cleanup
        cluster.stop()
        say("stopped")
    return code


def _supervise(cluster, say) -> int:
    """Serve until a signal arrives. The cluster's supervisor restarts processes that exit (backoff, crash-loop
    give-up); the launch ends only when the router or every worker has been given up. Signals are held during
    a step so that a restart in progress is never cut between its spawn and its bookkeeping."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    while True:
        time.sleep(0.5)
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            cluster.supervise_step()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
        gone = set(cluster.given_up())
        if cluster.routers and all(r.name in gone for r in cluster.routers):
            print("pdserve: every router exited and none is restarted; stopping", file=sys.stderr)
            return 1
        if cluster.workers and all(w.name in gone for w in cluster.workers):
            print("pdserve: every worker exited and none is restarted; stopping", file=sys.stderr)
            return 1


# Subcommands that own their parser live next to their code: ``pdserve NAME ...`` calls ``MODULE.main(rest)``.
SUBCOMMANDS = {
    "bench": ("pdserve.bench.cli", "run a workload against an OpenAI-compatible URL, or compare configurations"),
    "plan": ("pdserve.plan.cli", "size KV, simulate and recommend colocated, elastic or xPyD for a model and traffic"),
    "store": ("pdserve.store.cli", "run a KV pool master or store node"),
    "indexer": ("pdserve.indexer.__main__", "run the KV indexer service shared by router replicas (docs/indexer.md)"),
    "picker": ("pdserve.picker.__main__", "run the conductor as a Gateway API Inference Extension endpoint picker"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    parser.error(f"unknown command {args.command}")  # pragma: no cover
    return 2


if __name__ == "__main__":
    sys.exit(main())
