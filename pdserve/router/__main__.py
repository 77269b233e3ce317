"""``python -m pdserve.router``: run the router (flags from the table of settings, as :class:`RouterConfig`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..settings.errors import ConfigError, config_fault
from ..settings.flags import add_flags, values_from_args
from .config import RouterConfig


def build_parser() -> argparse.ArgumentParser:
    """The worker lists by hand; every other flag from the table of settings (:mod:`pdserve.settings`)."""
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
    p.add_argument("--elastic", nargs="+", action="extend", default=[], metavar="URL",
                   help="workers with no fixed role (kv_both): each request runs colocated on one or split P -> D "
                        "over two, chosen per request (use with --policy conductor; instead of --prefill/--decode)")
    p.add_argument("--kv-events", nargs="+", action="extend", default=[], metavar="URL=ENDPOINT[,REPLAY]",
                   help="a worker's KV event publisher (its vLLM --kv-events-config endpoint, bound there, and "
                        "replay_endpoint): the router subscribes to it (repeatable; with --policy conductor)")
    add_flags(p, "router")
    return p


def config_from_args(argv: list[str] | None = None) -> RouterConfig:
    a = build_parser().parse_args(argv)
    pool_secret = os.environ.get("PDSERVE_TRANSFER_SECRET", "") if a.pool_master else ""
    return RouterConfig(model_dir=a.model_dir, prefill=tuple(a.prefill), decode=tuple(a.decode),
                        colocated=tuple(a.colocated), elastic=tuple(a.elastic), kv_events=tuple(a.kv_events),
                        admin_token=os.environ.get("PDSERVE_ADMIN_TOKEN", ""), pool_secret=pool_secret,
                        **values_from_args(a, "router"))


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
    except ConfigError as e:
        return config_fault("pdserve router", e)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .app import serve

    logging.getLogger("pdserve.router").info("router (%s) on http://%s:%d serving %s", config.mode, config.host,
                                             config.port, config.served_model_name)
    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
