"""``pdserve store master ...`` / ``pdserve store node ...``: run a pool process until SIGTERM/SIGINT.

Each prints one JSON line on stdout once it listens ({"role", "port", ...}) so scripts and tests can find
it; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from ..settings.errors import ConfigError, config_fault
from .config import MasterConfig, NodeConfig, parse_address, parse_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve store", description="KV pool processes (see docs/store.md)")
    sub = p.add_subparsers(dest="role", required=True)
    m = sub.add_parser("master", help="metadata server: key -> replicas, leases, LRU eviction")
    m.add_argument("--host", default="127.0.0.1")
    m.add_argument("--port", type=int, default=7600, help="control port (0: any free port)")
    m.add_argument("--replicas", type=int, default=1, help="copies per object, on distinct nodes")
    m.add_argument("--high-watermark", type=float, default=0.90)
    m.add_argument("--low-watermark", type=float, default=0.75)
    m.add_argument("--get-lease-s", "--lease-s", dest="get_lease_s", type=float, default=5.0,
                   help="how long a get keeps its objects from eviction (--lease-s: the old name)")
    m.add_argument("--node-timeout-s", type=float, default=3.0)
    m.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    m.add_argument("--secret", default="", help="shared secret (default: $PDSERVE_TRANSFER_SECRET)")
    n = sub.add_parser("node", help="store node: lends a host-memory arena and an SSD directory")
    n.add_argument("--master", required=True, help="the master's HOST:PORT")
    n.add_argument("--mem", default="1GiB", help="host memory lent to the pool (e.g. 512MiB, 4GiB)")
    n.add_argument("--disk-dir", default="", help="directory for the SSD tier's object files")
    n.add_argument("--disk", default="0", help="SSD tier bound (0: no SSD tier)")
    n.add_argument("--host", default="127.0.0.1")
    n.add_argument("--port", type=int, default=0, help="control port for the master's calls (0: free port)")
    n.add_argument("--transfer-port", type=int, default=0)
    n.add_argument("--advertise-host", default="")
    n.add_argument("--backend", default="auto", help="transfer backend: auto, tcp, local")
    n.add_argument("--node-id", default="")
    n.add_argument("--heartbeat-s", type=float, default=0.5)
    n.add_argument("--secret", default="")
    return p


def _run_until_signal(close) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(asctime)s [%(name)s] %(message)s", datefmt="%m-%d %H:%M:%S")
    try:
        if args.role == "master":
            from .master import Master

            mcfg = MasterConfig(secret=args.secret, host=args.host, port=args.port, replicas=args.replicas,
                                high_watermark=args.high_watermark, low_watermark=args.low_watermark,
                                get_lease_s=args.get_lease_s, node_timeout_s=args.node_timeout_s,
                                metrics_port=args.metrics_port)
            master = Master(mcfg)
            print(json.dumps({"role": "master", "host": mcfg.host, "port": master.port,
                              "metrics_port": mcfg.metrics_port}), flush=True)
            return _run_until_signal(master.close)
        from .node import StoreNode

        host, port = parse_address(args.master)
        ncfg = NodeConfig(master_host=host, master_port=port, mem_bytes=parse_size(args.mem, "--mem"),
                          disk_dir=args.disk_dir, disk_bytes=parse_size(args.disk, "--disk"), secret=args.secret,
                          host=args.host, port=args.port, transfer_port=args.transfer_port,
                          advertise_host=args.advertise_host, transfer_backend=args.backend,
                          node_id=args.node_id, heartbeat_s=args.heartbeat_s)
        node = StoreNode(ncfg)
        print(json.dumps({"role": "node", "node_id": node.node_id, "port": node.port,
                          "transfer_port": node.engine.segment().port}), flush=True)
        return _run_until_signal(node.close)
    except ConfigError as exc:
        return config_fault("pdserve store", exc)
    except OSError as exc:
        print(f"pdserve store: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())


def add_serve_flags(parser: argparse.ArgumentParser, default: object = argparse.SUPPRESS) -> None:
    """The KV pool flags of ``pdserve serve`` (LauncherConfig.pool*); ``default`` SUPPRESS lets a YAML
    config supply what the command line does not."""
    parser.add_argument("--pool", dest="pool", action="store_true", default=default,
                        help="start a KV pool (master + one store node) for the workers' connectors "
                             "(default: on whenever the connector is)")
    parser.add_argument("--no-pool", dest="pool", action="store_false", default=default, help="no KV pool")
    parser.add_argument("--pool-mem", default=default, metavar="SIZE",
                        help="host memory the pool node lends, e.g. 1GiB (default 1GiB)")
    parser.add_argument("--pool-disk", default=default, metavar="SIZE",
                        help="SSD tier size, e.g. 8GiB (default 0: no SSD tier)")
    parser.add_argument("--pool-disk-dir", default=default, metavar="DIR",
                        help="SSD tier folder (default: pool-ssd in the run folder, removed at stop)")
    parser.add_argument("--pool-port", type=int, default=default, help="pool master port (default: a free one)")
