"""``pdserve picker`` / ``python -m pdserve.picker``: the conductor as a Gateway API Inference Extension endpoint
picker (Envoy ext-proc over gRPC). Takes the router's flags (workers, --kv-events, --indexer, placement) and its
own (--picker-host, --picker-port).

    python -m pdserve.picker --model-dir DIR --prefill http://10.0.0.5:8000 --decode http://10.0.0.6:8000 \\
        --kv-events http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 --indexer http://indexer:8100
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from ..kube.discovery import DiscoveryConfigError
from ..router.__main__ import build_parser as router_parser
from ..router.config import RouterConfig, RouterConfigError
from ..settings.flags import add_flags, values_from_args
from .discovery import pools
from .picker import Picker
from .server import serve


def build_parser() -> argparse.ArgumentParser:
    """The router's flags (its policy defaulting to the conductor) and the picker's own."""
    p = router_parser()
    p.prog, p.description = "pdserve picker", "the conductor as a Gateway API Inference Extension endpoint picker"
    add_flags(p, "picker")
    p.set_defaults(policy="conductor")  # a picker is the conductor's placement (the router's default is round_robin)
    return p


def parse(argv: list[str] | None) -> tuple[RouterConfig, dict[str, Any]]:
    a = build_parser().parse_args(argv)
    pool_secret = os.environ.get("PDSERVE_TRANSFER_SECRET", "") if a.pool_master else ""
    config = RouterConfig(model_dir=a.model_dir, prefill=tuple(a.prefill), decode=tuple(a.decode),
                          colocated=tuple(a.colocated), elastic=tuple(a.elastic), kv_events=tuple(a.kv_events),
                          pool_secret=pool_secret, **values_from_args(a, "router"))
    mine = values_from_args(a, "picker")
    mine["dns"] = pools(mine["prefill_dns"], mine["decode_dns"])
    return config, mine


async def run(config: RouterConfig, mine: dict[str, Any]) -> None:
    picker = Picker(config, dns=mine["dns"], discovery_interval_s=mine["discovery_interval_s"])
    await picker.start()
    server = await serve(picker, mine["picker_host"], mine["picker_port"], mine["destination_port"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(5)
    await picker.close()


def main(argv: list[str] | None = None) -> int:
    try:
        config, mine = parse(argv)
    except (RouterConfigError, DiscoveryConfigError) as e:
        print(f"pdserve picker: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(config, mine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
