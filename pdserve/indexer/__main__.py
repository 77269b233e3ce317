"""``pdserve indexer`` / ``python -m pdserve.indexer``: the KV indexer service on its own.

    python -m pdserve.indexer --kv-events http://127.0.0.1:8001=ipc:///run/p0.kvpub,ipc:///run/p0.kvrpl \\
        --indexer-snapshot /var/lib/pdserve/index.snap --pool-master 127.0.0.1:7000
    python -m pdserve.indexer --prefill-dns pd-pdserve-prefill.llm.svc:8000 \\
        --decode-dns pd-pdserve-decode.llm.svc:8000 --kv-events-port 5557     # the chart's indexer pod
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from aiohttp import web

from ..kube.dns_follow import pools
from ..router.fleet.kv_events import Publisher
from ..settings.errors import ConfigError
from ..settings.flags import add_flags, values_from_args
from .app import create_app
from .service import IndexerConfig, IndexerService


def parse_publisher(entry: str) -> tuple[str, Publisher]:
    """``URL=ENDPOINT[,REPLAY]`` -> (URL, its publisher), as the router's ``--kv-events`` takes it."""
    url, sep, rest = entry.partition("=")
    endpoint, _, replay = rest.partition(",")
    if not sep or not url or not endpoint.startswith(("tcp://", "ipc://")) or (
            replay and not replay.startswith(("tcp://", "ipc://"))):
        raise ConfigError(f"--kv-events {entry!r}: use URL=ENDPOINT[,REPLAY] with tcp:// or ipc:// endpoints")
    return url.rstrip("/"), Publisher(endpoint, replay)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve indexer", description="the KV indexer service (docs/indexer.md)")
    p.add_argument("--kv-events", action="append", default=[], metavar="URL=ENDPOINT[,REPLAY]",
                   help="a worker's KV event publisher (repeat); more join through POST /register")
    add_flags(p, "indexer")
    return p


def config_from(a: argparse.Namespace) -> tuple[IndexerConfig, str, int]:
    v = values_from_args(a, "indexer")
    workers = [parse_publisher(e) for e in a.kv_events]
    secret = os.environ.get("PDSERVE_TRANSFER_SECRET", "") if v.get("pool_master") else ""
    cfg = IndexerConfig(block_size=v["block_size"], snapshot_path=v["indexer_snapshot"],
                        snapshot_interval_s=v["indexer_snapshot_interval_s"],
                        placeholder_ttl_s=v["placeholder_ttl_s"], pool_master=v["pool_master"], pool_secret=secret,
                        workers=workers, dns=pools(v["prefill_dns"], v["decode_dns"]),
                        kv_events_port=v["kv_events_port"], discovery_interval_s=v["discovery_interval_s"],
                        xxh3=v["xxh3"], xxh3_seed=v["xxh3_seed"], xxh3_max_blocks=v["xxh3_max_blocks"])
    if cfg.dns and not cfg.kv_events_port:
        raise ConfigError("--prefill-dns / --decode-dns need --kv-events-port: the port every worker's vLLM binds "
                          "its KV event publisher on (the chart's router.kvEventsPort, 5557)")
    return cfg, v["indexer_host"], v["indexer_port"]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = build_parser().parse_args(argv)
    try:
        cfg, host, port = config_from(a)
    except ConfigError as e:
        print(f"pdserve indexer: {e}", file=sys.stderr)
        return 2
    web.run_app(create_app(IndexerService(cfg)), host=host, port=port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
