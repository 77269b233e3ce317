"""The live view of the fleet (issue 40): ``GET /dashboard``, one static page (``router/static/dashboard.html``:
HTML and plain JavaScript, no build step) that polls ``GET /v1/pdserve/fleet`` every second and draws it.

The JSON reads only what the router's metrics and decision records already hold: each worker's roles and health
(the registry behind ``pdserve_router_worker_healthy``), its queue, running requests and KV use (the conductor's
``pdserve_worker_*`` gauges), the times it came back after being taken out (``pdserve_router_worker_returns_total``:
restarts as the router sees them), its mean prediction error (``*_prediction_error_ratio``), the last minute's
placements, rejections, migrations and moves (the decision records' placements, each stamped ``at`` when it closed;
the ring holds the newest 4096 requests), the router's counters (the page shows the increase of its admission 429s
over the samples it has seen), the early rejections' replay verdicts (``pdserve_conductor_refusal_verdicts_total``:
false refusals) and the newest decision records.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from .context import RouterContext

PAGE = Path(__file__).resolve().parent.parent / "static" / "dashboard.html"
RECENT = 12  # decision records the view lists
MINUTE_S = 60.0  # "the last minute": placements whose record closed this recently
Samples = dict[str, list[tuple[dict[str, str], float]]]


def samples(registry: CollectorRegistry) -> Samples:
    """Every sample of the registry (collectors read now), by sample name."""
    out: Samples = {}
    for family in registry.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def by_worker(rows: Iterable[tuple[dict[str, str], float]], label: str = "worker") -> dict[str, float]:
    """Sum of the samples per worker URL (its label is ``worker`` or ``url``)."""
    out: dict[str, float] = {}
    for labels, value in rows:
        url = labels.get(label, "")
        out[url] = out.get(url, 0.0) + value
    return out


def mean_ratio(m: Samples, name: str) -> dict[str, float]:
    """A ``*_prediction_error_ratio`` histogram's mean per worker (1: exact)."""
    sums, counts = by_worker(m.get(name + "_sum", [])), by_worker(m.get(name + "_count", []))
    return {w: round(sums[w] / n, 3) for w, n in counts.items() if n and w in sums}


def _total(m: Samples, name: str) -> float:
    return sum(v for _, v in m.get(name, []))


def _roles_now(m: Samples) -> dict[str, str]:
    return {labels["worker"]: labels.get("role", "") for labels, _ in m.get("pdserve_worker_running_requests", [])}


def _doing(queued: float | None, running: float | None) -> str:
    """What a worker does now by the conductor's view: prefilling, decoding, both, idle ("" unknown)."""
    if queued is None and running is None:
        return ""
    parts = [name for name, n in (("prefilling", queued), ("decoding", running)) if n]
    return " + ".join(parts) or "idle"


def workers_view(ctx: RouterContext, m: Samples) -> list[dict[str, Any]]:
    """One row per registered worker."""
    queued = by_worker(m.get("pdserve_worker_queued_prefill_tokens", []))
    running = by_worker(m.get("pdserve_worker_running_requests", []))
    kv = by_worker(m.get("pdserve_worker_kv_usage", []))
    returns = by_worker(m.get("pdserve_router_worker_returns_total", []), "url")
    ttft = mean_ratio(m, "pdserve_router_ttft_prediction_error_ratio")
    tpot = mean_ratio(m, "pdserve_router_tpot_prediction_error_ratio")
    roles = _roles_now(m)
    return [{"url": w.url, "roles": sorted(w.roles), "role_now": roles.get(w.url, ""), "healthy": w.healthy,
             "doing": _doing(queued.get(w.url), running.get(w.url)),
             "last_error": w.last_error, "queued_prefill_tokens": queued.get(w.url), "running_requests":
             running.get(w.url), "kv_usage": kv.get(w.url), "returns": int(returns.get(w.url, 0)),
             "ttft_error_ratio": ttft.get(w.url), "tpot_error_ratio": tpot.get(w.url)} for w in ctx.registry]


def counters_view(m: Samples) -> dict[str, Any]:
    """The router's totals; the page takes their increase over the last minute."""
    placements = {labels["kind"]: v for labels, v in m.get("pdserve_conductor_decisions_total", [])}
    return {"placements": placements, "admission_rejected": _total(m, "pdserve_router_rejected_total"),
            "migrations": _total(m, "pdserve_router_migrations_total"),
            "requests": _total(m, "pdserve_router_requests_total"),
            "worker_errors": _total(m, "pdserve_router_worker_errors_total"),
            "refusal_verdicts": refusals_view(m)}


def refusals_view(m: Samples) -> dict[str, Any]:
    """The early rejections' replay verdicts (false_refusal, right, unverified) and the false-refusal share."""
    out: dict[str, Any] = {}
    for labels, v in m.get("pdserve_conductor_refusal_verdicts_total", []):
        out[labels["verdict"]] = out.get(labels["verdict"], 0) + int(v)
    share = m.get("pdserve_conductor_false_refusal_ratio")
    out["false_refusal_ratio"] = round(share[0][1], 4) if share else None
    return out


def recent_view(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest decision records, one line each: the request, its placements' pairs and rules, a rejection."""
    out = []
    for rec in records:
        placed = rec.get("placements", [])
        out.append({"request_id": rec.get("request_id", ""), "placements": [
            {k: p.get(k) for k in ("kind", "prefill", "decode", "rule", "why", "predicted", "measured", "rejection")}
            for p in placed]})
    return out


def minute_view(placements: list[dict[str, Any]]) -> dict[str, int]:
    """The decision records' placements of the last minute: by kind, rejections, migrations and moves."""
    out: dict[str, int] = {}
    for p in placements:
        key = "rejected" if p.get("kind") == "reject" else f"placed {p.get('kind')}"
        out[key] = out.get(key, 0) + 1
        if p.get("why") in ("migration", "move"):
            out[p["why"] + "s"] = out.get(p["why"] + "s", 0) + 1
    return out


def fleet(ctx: RouterContext) -> dict[str, Any]:
    """The view's JSON (see the module docstring)."""
    m = samples(ctx.metrics.registry)
    log = getattr(ctx.placement, "decisions", None)
    now = time.time()
    return {"time": now, "policy": ctx.config.policy, "workers": workers_view(ctx, m),
            "last_minute": minute_view(log.placements_since(now - MINUTE_S) if log is not None else []),
            "counters": counters_view(m), "recent": recent_view(log.recent(RECENT) if log is not None else [])}


def add_routes(app: web.Application, ctx: RouterContext) -> None:
    async def page(request: web.Request) -> web.FileResponse:
        return web.FileResponse(PAGE, headers={"Cache-Control": "no-cache"})

    async def state(request: web.Request) -> web.Response:
        return web.json_response(fleet(ctx), headers={"Cache-Control": "no-store"})

    app.router.add_get("/dashboard", page)
    app.router.add_get("/v1/pdserve/fleet", state)
