"""``pdserve picker`` / ``python -m pdserve.picker``: the conductor as a Gateway API Inference Extension endpoint
picker (Envoy ext-proc over gRPC). Takes the router's flags (workers, --kv-events, --indexer, placement) and its
own (--picker-host, --picker-port).

    python -m pdserve.picker --model-dir DIR --prefill http://10.0.0.5:8000 --decode http://10.0.0.6:8000 \\
        --kv-events http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 --indexer http://indexer:8100
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from ..router.__main__ import build_parser as router_parser
from ..router.config import RouterConfig, RouterConfigError
from ..settings.flags import add_flags, values_from_args
from .picker import Picker
from .server import serve


def parse(argv: list[str] | None) -> tuple[RouterConfig, str, int]:
    p = router_parser()
    p.prog, p.description = "pdserve picker", "the conductor as a Gateway API Inference Extension endpoint picker"
    add_flags(p, "picker")
    p.set_defaults(policy="conductor")  # a picker is the conductor's placement (the router's default is round_robin)
    a = p.parse_args(argv)
    pool_secret = os.environ.get("PDSERVE_TRANSFER_SECRET", "") if a.pool_master else ""
    config = RouterConfig(model_dir=a.model_dir, prefill=tuple(a.prefill), decode=tuple(a.decode),
                          colocated=tuple(a.colocated), elastic=tuple(a.elastic), kv_events=tuple(a.kv_events),
                          pool_secret=pool_secret, **values_from_args(a, "router"))
    mine = values_from_args(a, "picker")
    return config, mine["picker_host"], mine["picker_port"]


async def run(config: RouterConfig, host: str, port: int) -> None:
    picker = Picker(config)
    await picker.start()
    server = await serve(picker, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(5)
    await picker.close()


def main(argv: list[str] | None = None) -> int:
    try:
        config, host, port = parse(argv)
    except RouterConfigError as e:
        print(f"pdserve picker: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(config, host, port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
