"""The pdserve router: the one public OpenAI-compatible port in front of prefill and decode vLLM workers.

    python -m pdserve.router --model-dir DIR --prefill http://127.0.0.1:P --decode http://127.0.0.1:D
    python -m pdserve.router --model-dir DIR --colocated http://127.0.0.1:W1 http://127.0.0.1:W2   # baseline

Layers, each importing only those below it (docs/architecture.md, "Router modules by concept";
tests/unit/test_router_layers.py): the base (config: RouterConfig; errors; metrics; admission), api/ (request
parsing and answer shapes), workers/ (one worker's HTTP client and streams), fleet/ (registry, health, placement,
KV event feeds), run/ (one request's run: attempts, P -> D, relay, answer), endpoints/ (every handler, through the
one front door, endpoints/intake.py), app (wiring and lifecycle).
"""

from .config import RouterConfig, RouterConfigError

__all__ = ["RouterConfig", "RouterConfigError", "create_app"]


def create_app(*args, **kwargs):  # lazy: keeps `import pdserve.router` free of aiohttp/transformers
    from .app import create_app as _create_app

    return _create_app(*args, **kwargs)
