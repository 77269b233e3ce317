"""``python -m pdserve.router``: run the router (flags mirror :class:`RouterConfig`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..rules import POLICIES
from .api.limits import DEFAULT_MAX_BODY_BYTES
from .config import RouterConfig, RouterConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.router",
                                description="pdserve router: the OpenAI-compatible port in front of prefill/decode "
                                            "(or colocated) vLLM workers")
    p.add_argument("--model-dir", required=True, help="model folder (tokenizer, chat template, config.json)")
    p.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                   help="prefill worker base URL(s), e.g. http://127.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                   help="decode worker base URL(s) (repeatable)")
    p.add_argument("--colocated", nargs="+", action="extend", default=[], metavar="URL",
                   help="baseline: workers that serve whole requests, round-robin (instead of --prefill/--decode)")
    p.add_argument("--mode", dest="mode_hint", default="", choices=("", "colocated", "disaggregated", "elastic"),
                   help="start with no workers in this mode; workers join via POST /v1/pdserve/workers")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default="", help="name clients use in 'model' (default: --model-dir)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context limit (prompt + max_tokens) to enforce; set to the workers' --max-model-len "
                        "(default: config.json max_position_embeddings)")
    p.add_argument("--connect-timeout-s", type=float, default=5.0)
    p.add_argument("--upstream-idle-timeout-s", type=float, default=120.0,
                   help="fail a request when its worker sends nothing for this long")
    p.add_argument("--health-timeout-s", type=float, default=2.0)
    p.add_argument("--health-interval-s", type=float, default=5.0, help="background health probes (0: off)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help=f"largest request body accepted, in bytes (413 above it; default {DEFAULT_MAX_BODY_BYTES}"
                        " = 4 MiB)")
    p.add_argument("--kv-connector", default="pdserve", choices=("pdserve", "nixl"),
                   help="the workers' KV data plane: pdserve (pdserve's connector, default) or nixl (vLLM's "
                        "NixlConnector); the router speaks its P -> D hand-off")
    c = p.add_argument_group("placement (pdserve.conductor)")
    c.add_argument("--policy", default="round_robin", choices=POLICIES,
                   help="round_robin (default), least_loaded, or conductor: prefix-, load- and SLO-aware")
    c.add_argument("--kv-events-bind", default="", metavar="ENDPOINT",
                   help="bind this ZMQ endpoint for workers' KV events (e.g. tcp://127.0.0.1:5557); workers set "
                        "--kv-events-config endpoint to it and topic to their own URL")
    c.add_argument("--ttft-slo-ms", type=float, default=None, help="reject (429) requests predicted to miss it")
    c.add_argument("--tpot-slo-ms", type=float, default=None, help="reject (429) requests predicted to miss it")
    c.add_argument("--local-prefill-tokens", type=int, default=None,
                   help="run requests with at most this many uncached prompt tokens on the decode worker alone "
                        "(default: learned from the cost model)")
    c.add_argument("--block-size", type=int, default=128, help="workers' KV block size in tokens (default 128)")
    c.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="skip the start-up timing of each worker (the cost model then starts from defaults)")
    c.add_argument("--pool-master", default="", metavar="HOST:PORT",
                   help="KV pool master: pooled prefixes count as loadable (secret in $PDSERVE_TRANSFER_SECRET)")
    c.add_argument("--load-interval-s", type=float, default=1.0, help="period of worker /metrics reads")
    f = p.add_argument_group("failures and overload")
    f.add_argument("--migration-limit", type=int, default=2,
                   help="times one request may move to another worker when its worker dies mid-request (default 2)")
    f.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="every request's deadline; past it 504 (or an error event) and its KV is freed (default 600)")
    f.add_argument("--handoff-timeout-s", type=float, default=60.0,
                   help="P's answer -> D's first token deadline (default 60)")
    f.add_argument("--max-inflight", type=int, default=2048,
                   help="requests in flight in the router; 429 + Retry-After above (0: no limit; default 2048)")
    f.add_argument("--max-inflight-per-worker", type=int, default=512,
                   help="requests placed on one worker, every policy; 429 when all are full (0: no limit; "
                        "default 512)")
    f.add_argument("--probe-failures", type=int, default=3,
                   help="failed health probes in a row (timeouts) before a worker is taken out (default 3)")
    f.add_argument("--probe-window-s", type=float, default=10.0,
                   help="... and they must span at least this long (default 10); refused connections count at once")
    p.add_argument("--tool-call-parser", default="", metavar="NAME",
                   help="vLLM tool parser for tool_choice auto (e.g. hermes), as `vllm serve --tool-call-parser`")
    p.add_argument("--elastic", nargs="+", action="extend", default=[], metavar="URL",
                   help="workers with no fixed role (kv_both): each request runs colocated on one or split P -> D "
                        "over two, chosen per request (use with --policy conductor; instead of --prefill/--decode)")
    c.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="the workers' vLLM --max-num-batched-tokens (per-step token budget): elastic placement "
                        "models a prefill on a decoding worker as chunked into its steps (default: unknown)")
    c.add_argument("--no-moves", dest="moves", action="store_false",
                   help="elastic: never move running decodes off a worker that starts a long prefill (default: move "
                        "them when the conductor predicts it pays)")
    return p


def config_from_args(argv: list[str] | None = None) -> RouterConfig:
    a = build_parser().parse_args(argv)
    return RouterConfig(model_dir=a.model_dir, prefill=tuple(a.prefill), decode=tuple(a.decode),
                        colocated=tuple(a.colocated), host=a.host, port=a.port,
                        served_model_name=a.served_model_name, max_model_len=a.max_model_len,
                        connect_timeout_s=a.connect_timeout_s, upstream_idle_timeout_s=a.upstream_idle_timeout_s,
                        health_timeout_s=a.health_timeout_s, health_interval_s=a.health_interval_s,
                        log_level=a.log_level, policy=a.policy, kv_events_bind=a.kv_events_bind,
                        ttft_slo_ms=a.ttft_slo_ms, tpot_slo_ms=a.tpot_slo_ms,
                        local_prefill_tokens=a.local_prefill_tokens, block_size=a.block_size,
                        calibrate=a.calibrate, load_interval_s=a.load_interval_s,
                        admin_token=os.environ.get("PDSERVE_ADMIN_TOKEN", ""), mode_hint=a.mode_hint,
                        pool_master=a.pool_master, max_body_bytes=a.max_body_bytes,
                        pool_secret=os.environ.get("PDSERVE_TRANSFER_SECRET", "") if a.pool_master else "",
                        kv_connector=a.kv_connector,
                        migration_limit=a.migration_limit, request_timeout_s=a.request_timeout_s,
                        handoff_timeout_s=a.handoff_timeout_s, max_inflight=a.max_inflight or None,
                        max_inflight_per_worker=a.max_inflight_per_worker or None,
                        probe_failures=a.probe_failures, probe_window_s=a.probe_window_s,
                        tool_call_parser=a.tool_call_parser, elastic=tuple(a.elastic),
                        max_num_batched_tokens=a.max_num_batched_tokens, moves=a.moves)


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
    except RouterConfigError as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .app import serve

    logging.getLogger("pdserve.router").info("router (%s) on http://%s:%d serving %s", config.mode, config.host,
                                             config.port, config.served_model_name)
    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
