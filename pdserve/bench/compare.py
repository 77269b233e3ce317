"""Run the same workloads against several serving configurations, one after another on the same cores.

Configuration names (:func:`launcher_config`):

- ``colocatedN``: N plain vLLM workers behind the router, the machine's cores split evenly between them
  (``colocated1`` = one worker on every core, ``colocated2`` = two workers on half each).
- ``PpDd`` (``1p1d``, ``1p2d`` ...): disaggregated, one core per worker, the router's default policy.
- ``PpDd-POLICY`` (``1p1d-conductor``, ``1p1d-least_loaded``): the same with the router's placement policy
  ``POLICY`` (needs ``LauncherConfig.policy``; a clear error otherwise).
- ``PpDd-PLANE`` (``1p1d-nixl``, ``1p1d-mooncake``): the same on vLLM's NixlConnector or MooncakeConnector
  (``--kv-connector``) instead of pdserve's connector.
- ``PpDd-POOL`` (``1p1d-nopool``, ``1p1d-pool``, ``1p1d-mooncake-store``): the KV pool off, pdserve's pool on, or
  Mooncake Store as the pool (``--pool-backend mooncake``: with the nixl or mooncake plane). Without a pool
  word the launcher's default holds (pdserve's pool with pdserve's connector, none with vLLM's).
  ``-nocheck`` turns the KV checksums off (``--no-kv-checksum``), to measure what they cost under load.
  The words combine in any order: ``2p1d-mooncake-store-conductor``, ``1p1d-nopool-nocheck``.
- ``elasticN``: N workers with no fixed role (``pdserve serve --elastic N``), the cores split evenly between
  them, the conductor choosing colocated or split P -> D per request; ``elasticN-nomoves``: the same with the
  router's ``--no-moves`` (running decodes never move off a worker that starts a long prefill).

Each configuration is started once with :class:`pdserve.launch.Cluster`, health-gated, warmed up, then every
workload runs against it in order; counters (decode workers' ``vllm:pdserve_kv_*``, the router's
``pdserve_router_*``) are scraped before and after each workload. Workload ``k`` uses seed ``k`` unless its spec
sets one, so a configuration never gets prefix-cache hits from an earlier workload, and every configuration gets
the same prompts.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..launch.config import ConfigError, LauncherConfig
from .kv_counters import kv_figures, worker_counters
from .metrics import SLO, counter_phases, phase_summary, summarize
from .prom import delta, scrape
from .runner import RunOptions, RunResult, run
from .workload import build_workload, parse_spec

_NAME = re.compile(r"^(?:colocated(?P<c>\d+)|elastic(?P<e>\d+)(?P<nomoves>-nomoves)?"
                   r"|(?P<p>\d+)p(?P<d>\d+)d(?P<words>(?:-[a-z_]+)*))$")
PLANES = ("nixl", "mooncake")  # --kv-connector
POOLS: dict[str, dict[str, Any]] = {"nopool": {"pool": False}, "pool": {"pool": True},
                                    "store": {"pool_backend": "mooncake"}}
CHECKS: dict[str, dict[str, Any]] = {"nocheck": {"kv_checksum": False}}  # --no-kv-checksum


@dataclass(frozen=True)
class CompareSettings:
    """What every configuration shares."""

    model: str = ""
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    max_num_batched_tokens: int | None = None
    dtype: str | None = None
    cores: tuple[int, ...] = ()
    worker_args: tuple[str, ...] = ()
    run_dir: str = ""
    worker_timeout_s: float = 600.0


@dataclass
class WorkloadPlan:
    """One workload run: a label for tables and plots, the spec string and its overrides (rate, seed)."""

    label: str
    spec: str
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float | None:
        r = self.overrides.get("rate")
        if r is None:
            r = parse_spec(self.spec)[1].get("rate")
        return None if r is None else float(r)


def plan_workloads(specs: list[str], rates: list[float] | None = None) -> list[WorkloadPlan]:
    """Every spec, at every rate when ``rates`` is given; workload k gets seed k unless its spec sets one."""
    plans: list[WorkloadPlan] = []
    for spec in specs:
        kind, params = parse_spec(spec)
        rate_list: list[float | None] = list(rates) if rates else [None]
        for rate in rate_list:
            ov: dict[str, Any] = {}
            label = params.get("name", spec)
            if rate is not None:
                ov["rate"] = rate
                label = f"{label}@{rate:g}"
            plans.append(WorkloadPlan(label, spec, ov))
    for k, p in enumerate(plans):
        if "seed" not in parse_spec(p.spec)[1]:
            p.overrides["seed"] = k
    return plans


def available_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def launcher_config(name: str, s: CompareSettings) -> LauncherConfig:
    """The :class:`LauncherConfig` a configuration name stands for (see the module docstring)."""
    m = _NAME.match(name)
    if not m:
        raise ConfigError(f"configuration {name!r} unknown: use colocatedN (e.g. colocated2), PpDd (e.g. 1p1d), "
                          "PpDd-WORDS (a policy, plane or pool: 1p1d-conductor, 1p1d-nixl, 1p1d-mooncake-store) "
                          "or elasticN (e.g. elastic2)")
    cores = s.cores or available_cores()
    common: dict[str, Any] = dict(model=s.model, port=0, cores=cores, max_model_len=s.max_model_len,
                                  kv_cache_gib=s.kv_cache_gib, max_num_batched_tokens=s.max_num_batched_tokens,
                                  dtype=s.dtype, worker_args=s.worker_args, worker_timeout_s=s.worker_timeout_s)
    if s.run_dir:
        common["run_dir"] = str(Path(s.run_dir) / name)
    if m.group("c"):
        n = int(m.group("c"))
        if n < 1:
            raise ConfigError(f"{name}: colocated needs at least one worker")
        return LauncherConfig(colocated=n, cores_per_worker=max(1, len(cores) // n), **common)
    if m.group("e"):
        n = int(m.group("e"))
        if n < 1:
            raise ConfigError(f"{name}: elastic needs at least one worker")
        router_args = ("--no-moves",) if m.group("nomoves") else ()
        return LauncherConfig(elastic=n, policy="conductor", cores_per_worker=max(1, len(cores) // n),
                              router_args=router_args, **common)
    common.update(_split_words(name, m.group("words")))
    return LauncherConfig(prefill=int(m.group("p")), decode=int(m.group("d")), cores_per_worker=1, **common)


def _split_words(name: str, words: str) -> dict[str, Any]:
    """``-nixl-store-conductor`` -> the LauncherConfig fields those words set (one plane, pool, checks, policy
    each)."""
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for word in [w for w in words.split("-") if w]:
        kind = "plane" if word in PLANES else "pool" if word in POOLS else "checks" if word in CHECKS else "policy"
        if kind in seen:
            raise ConfigError(f"{name}: two {kind} words ({seen[kind]!r}, {word!r}); give one")
        seen[kind] = word
        if kind == "plane":
            out["kv_connector"] = word
        elif kind == "pool":
            out.update(POOLS[word])
        elif kind == "checks":
            out.update(CHECKS[word])
        else:
            if "policy" not in {f.name for f in fields(LauncherConfig)}:
                raise ConfigError(f"{name}: this pdserve's LauncherConfig has no 'policy' field yet (the router's "
                                  "placement policies land with the conductor); drop the -POLICY suffix")
            out["policy"] = word
    return out


def _vocab_size(model_dir: Path) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    if not vocab:
        raise ConfigError(f"{model_dir}/config.json has no vocab_size; pass a Hugging Face model folder")
    return int(vocab)


def _counters(urls: list[str], prefix: str, labels: bool = False) -> dict[str, float]:
    totals: dict[str, float] = {}
    for url in urls:
        try:
            for k, v in scrape(url, prefix, labels=labels).items():
                totals[k] = totals.get(k, 0.0) + v
        except OSError:
            continue  # a worker without /metrics (or gone): its counters are missing, not fatal
    return totals


def run_on_cluster(cluster: Any, plans: list[WorkloadPlan], slo: SLO, opts: dict[str, Any],
                   on_result: Callable[[str, RunResult], None] | None = None,
                   max_model_len: int | None = None) -> dict[str, Any]:
    """Every planned workload against a started cluster; returns ``{label: summary}``."""
    vocab = _vocab_size(cluster.model_dir)
    decoders = cluster.worker_urls("decode")
    out: dict[str, Any] = {}
    for plan in plans:
        wl = build_workload(plan.spec, vocab_size=vocab, max_model_len=max_model_len, overrides=plan.overrides)
        wl.name = plan.label
        kv0 = _counters(decoders, "vllm:pdserve_kv_")
        r0 = _counters([cluster.router_url], "pdserve_router_handoffs_total", labels=True)
        roles = {role: cluster.worker_urls(role) for role in ("prefill", "decode", "colocated", "elastic")}
        w0 = worker_counters(roles)
        result = run(wl, RunOptions(url=cluster.router_url, model=cluster.model_name, **opts))
        figures = kv_figures(w0, worker_counters(roles), sum(1 for r in result.records if r.ok))
        kv = delta(kv0, _counters(decoders, "vllm:pdserve_kv_"))
        rt = delta(r0, _counters([cluster.router_url], "pdserve_router_handoffs_total", labels=True))
        summary = summarize(result.records, result.wall_s, slo)
        summary.update(phase_summary(result.records))
        summary.update(counter_phases(kv, rt, summary.get("ttft_p50_ms"), summary.get("handoff_p50_ms")))
        summary.update(figures)
        summary["offered_rate"] = wl.offered_rate
        summary["truncated"] = result.truncated
        summary["workload_info"] = wl.info
        errors = [r.error for r in result.records if not r.ok]
        if errors:
            summary["first_error"] = errors[0]
        out[plan.label] = summary
        if on_result:
            on_result(plan.label, result)
    return out


def compare(configs: list[str], plans: list[WorkloadPlan], settings: CompareSettings, slo: SLO,
            out_dir: Path, opts: dict[str, Any] | None = None,
            log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Run ``plans`` on each configuration in turn; raw records go to ``out_dir/raw``; returns the results dict
    that :func:`pdserve.bench.report.write_report` renders."""
    from ..launch import Cluster
    from ..launch.plan import worker_dtype

    cfgs = {name: launcher_config(name, settings) for name in configs}  # validate all names before starting any
    for plan in plans:  # and every workload (a missing trace file fails here, not after the first start-up)
        build_workload(plan.spec, max_model_len=settings.max_model_len, overrides=plan.overrides)
    raw = out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"configs": {}, "order": list(configs), "workloads": [p.label for p in plans],
                               "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
                               "settings": {k: v for k, v in settings.__dict__.items()},
                               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "cores": list(settings.cores or available_cores())}
    choice = worker_dtype(settings.dtype)  # every configuration's workers: --dtype, else the CPU rule's
    results["dtype"] = {"dtype": choice.dtype, "reason": choice.reason}
    log(f"[compare] workers run in {choice.describe()}")
    for name, cfg in cfgs.items():
        log(f"[compare] {name}: starting ({cfg.mode}, {cfg.num_workers} worker(s))")
        t_start = time.monotonic()

        def save(label: str, result: RunResult, name: str = name) -> None:
            slug = re.sub(r"[^A-Za-z0-9_.@-]+", "_", label)
            (raw / f"{name}__{slug}.json").write_text(json.dumps(result.to_dict()))

        def log_line(s: str, n: str = name) -> None:
            log(f"[{n}] {s}")

        try:
            with Cluster(cfg, log=log_line) as cluster:
                startup = time.monotonic() - t_start
                per_wl = run_on_cluster(cluster, plans, slo, dict(opts or {}), on_result=save,
                                        max_model_len=settings.max_model_len)
        except Exception as exc:  # noqa: BLE001 - one configuration failing must not lose the others' results
            log(f"[compare] {name}: failed: {type(exc).__name__}: {exc}")
            results.setdefault("failed", {})[name] = f"{type(exc).__name__}: {exc}"
            continue
        results["configs"][name] = {"startup_s": round(startup, 1), "mode": cfg.mode,
                                    "workers": cfg.num_workers, "workloads": per_wl}
        log(f"[compare] {name}: done")
    return results
