"""The pdserve router: the one public OpenAI-compatible port in front of prefill and decode vLLM workers.

    python -m pdserve.router --model-dir DIR --prefill http://127.0.0.1:P --decode http://127.0.0.1:D
    python -m pdserve.router --model-dir DIR --colocated http://127.0.0.1:W1 http://127.0.0.1:W2   # baseline

Modules: config (RouterConfig), protocol (OpenAI schemas), tokenizer (chat template), registry (the workers:
membership, roles, health), placement (the conductor's seam) and ticket (one request's placement lifecycle),
workers (HTTP clients), handoff (P -> D), membership (the /v1/pdserve/workers API), metrics (Prometheus), app
(aiohttp server).
"""

from .config import RouterConfig, RouterConfigError

__all__ = ["RouterConfig", "RouterConfigError", "create_app"]


def create_app(*args, **kwargs):  # lazy: keeps `import pdserve.router` free of aiohttp/transformers
    from .app import create_app as _create_app

    return _create_app(*args, **kwargs)
