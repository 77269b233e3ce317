"""The router's HTTP server (aiohttp): the one public port.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming and not), POST /v1/messages and
/v1/responses (run as chat requests: :mod:`.endpoints.anthropic_messages`, :mod:`.endpoints.responses`), POST
/tokenize and /detokenize (:mod:`.endpoints.tokenize`), GET /v1/models and POST /v1/load_lora_adapter,
/v1/unload_lora_adapter (the served model and its LoRA adapters: :mod:`.api.model_catalog`), GET /health (200
only when every configured worker answers its /health), GET /ready (200 while a healthy worker can serve requests
end to end, "degraded" with one role gone: the Kubernetes readiness probe), GET /metrics (Prometheus text), and
worker membership: GET/POST/DELETE /v1/pdserve/workers (admin token or loopback only); GET /openapi.json describes them.
Input limits (body size, JSON nesting, prompt length) are in :mod:`.api.limits`.

This module is wiring and lifecycle only: :class:`Router` builds the parts (the registry and placement, the front
door, the worker session, the background loops) and starts and stops them; every handler is in :mod:`.endpoints`
(each module there adds its own routes), every background loop an object of :mod:`.fleet`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from ..conductor import ConductorConfig
from ..conductor.moves import MoveConfig
from ..settings.lora import parse_lora_modules
from ..settings.targets import handed_on
from . import endpoints
from .api.limits import body_too_large
from .api.model_catalog import ModelCatalog
from .api.tokenizer import PromptTokenizer
from .api.tools import ToolSupport
from .config import RouterConfig, kv_bytes_per_token
from .endpoints.context import RouterContext
from .endpoints.intake import Intake
from .errors import RouterError
from .fleet.adapter_sync import AdapterSync
from .fleet.calibration import Calibration
from .fleet.health_monitor import HealthMonitor
from .fleet.kv_feeds import KVFeeds
from .fleet.load_probe import LoadFollower
from .fleet.placement import ConductorPlacement, Placement, make_placement
from .fleet.prediction_error import PredictionErrors
from .fleet.registry import WorkerRegistry
from .fleet.shared_adapters import AdapterFile
from .fleet.shared_membership import MembershipFile
from .metrics import ConductorCollector, RouterMetrics
from .run.kv_protocol import protocol_for
from .tracing import Tracing, trace_middleware
from .workers.session import WorkerSession

log = logging.getLogger("pdserve.router")

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router")


class Router:
    """The parts of one app, their wiring, and their start and stop."""

    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer | None = None,
                 placement: Placement | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or PromptTokenizer(config.model_dir)
        self.metrics = RouterMetrics()
        # the conductor's and the moves' settings as the table hands them on (units converted: SLOs ms -> s)
        self.placement: Placement = placement or make_placement(
            WorkerRegistry(config.all_workers()), ConductorConfig(**handed_on(config, "conductor")),
            kv_bytes_per_token(config.model_dir), MoveConfig(**handed_on(config, "moves")))
        self.registry: WorkerRegistry = self.placement.registry  # the one owner of membership and health
        self.registry.probe_failures, self.registry.probe_window_s = config.probe_failures, config.probe_window_s
        self.workers = WorkerSession(config.connect_timeout_s, config.upstream_idle_timeout_s)
        self.kv = KVFeeds(config)
        self.shared: MembershipFile | None = None  # run-time membership shared with the other replicas
        if config.membership_file:
            self.shared = MembershipFile(config.membership_file, self.registry, self.kv.publishers)
        # the served model and its LoRA adapters: the names ``model`` may take (api/model_catalog.py)
        self.models = ModelCatalog(config.served_model_name, config.model_dir, config.max_model_len,
                                   int(time.time()), parse_lora_modules(config.lora_modules), config.enable_lora)
        # a worker back without its adapters gets them again (checked in each health probe)
        self.adapter_sync = AdapterSync(self.models, self.workers.get_session, config.health_timeout_s)
        self.shared_adapters: AdapterFile | None = None  # the adapter list shared with the other replicas
        if self.shared is not None and self.models.lora:
            self.shared_adapters = AdapterFile(self.shared.file, self.models)
        self.tools = ToolSupport(config.tool_call_parser, self.tokenizer.tok, config.served_model_name)
        self.health = HealthMonitor(self.registry, self.workers, self.adapter_sync, self.metrics,
                                    config.health_timeout_s, config.health_interval_s)
        self.calibration = Calibration()
        self.intake = Intake(config, self.tokenizer, self.models, self.tools, self.metrics, self.placement,
                             protocol_for(config.kv_connector, config.mooncake_bootstrap_port,
                                          config.mooncake_bootstrap, config.early_dispatch,
                                          config.early_continue), self.workers)
        self.tracing = Tracing.of(config)  # OpenTelemetry (router/tracing/); None: off, no span is made
        self._tasks: list[asyncio.Task] = []
        self.registry.subscribe(self.kv)
        if self.conducted is not None:
            self.metrics.registry.register(ConductorCollector(self.conducted, self.kv.batches))
            self.conducted.errors = PredictionErrors(self.metrics.registry)

    @property
    def conducted(self) -> ConductorPlacement | None:
        return self.placement if isinstance(self.placement, ConductorPlacement) else None

    @property
    def events(self) -> Any:
        """The KV event feed (None until started, and without the conductor)."""
        return self.kv.events

    @property
    def pool(self) -> Any:
        """What follows the KV pool's contents (None without one)."""
        return self.kv.pool

    def context(self) -> RouterContext:
        """What the endpoints are given."""
        return RouterContext(self.config, self.tokenizer, self.metrics, self.models, self.registry, self.placement,
                             self.workers, self.intake, self.health, self.calibration, self.kv, self.shared)

    # ---- lifecycle ----
    async def start(self, app: web.Application) -> None:
        c = self.config
        _ = self.tokenizer.chars_per_token  # the prompt-length bound reads the vocabulary once, before any request
        self.workers.open()
        if c.health_interval_s > 0:
            self._run(self.health.run())
        for shared in (self.shared, self.shared_adapters):  # before the KV event feed: it follows the file's workers
            if shared is not None:
                shared.start()
                self._run(shared.follow())
        cp = self.conducted
        if cp is not None and c.policy != "round_robin":
            await self.kv.start(cp, self.registry, self.workers.get_session())
            self._run(LoadFollower(self.registry, cp.conductor, self.workers.get_session, c.health_timeout_s,
                                   c.load_interval_s).run())
            if c.calibrate and c.policy == "conductor":
                self._run(self.calibration.run(self.workers.started(), cp.conductor, list(self.registry),
                                               self.tokenizer.vocab_size, c.max_model_len))
        if c.tool_call_parser:  # import vLLM's parser off the event loop, before the first tool request
            self._run(self._load_tool_parser())

    def _run(self, loop: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.create_task(loop))

    async def _load_tool_parser(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.tools.parser_cls)
        except RouterError as e:
            log.error("--tool-call-parser: %s", e.message)

    async def stop(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        await self.kv.close()
        await self.workers.close()
        if self.tracing is not None:  # flush the spans still queued (blocking: off the loop)
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.close)

    def decision_record(self, request_id: str) -> dict[str, Any] | None:
        """The request's decision record (None without the conductor's ring or once it is gone)."""
        log = getattr(self.placement, "decisions", None)
        return log.get(request_id) if log is not None else None


@web.middleware
async def _errors_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                             ) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return web.json_response(body_too_large(request.app[ROUTER_KEY].config.max_body_bytes).to_dict(), status=413)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        etype = "invalid_request_error" if e.status < 500 else "server_error"
        err = RouterError(e.status, f"{e.reason}: {request.method} {request.path}", etype)
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None  # a 405 names the methods
        return web.json_response(err.to_dict(), status=e.status, headers=allow)
    except RouterError as e:
        return web.json_response(e.to_dict(), status=e.status, headers=e.headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # a JSON error, never a traceback: that goes to the log
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.json_response(RouterError(500, f"internal router error: {e}", "server_error").to_dict(),
                                 status=500)


def create_app(config: RouterConfig, tokenizer: PromptTokenizer | None = None,
               placement: Placement | None = None) -> web.Application:
    """The aiohttp app (serve it with handler_cancellation=True so client disconnects abort worker calls)."""
    router = Router(config, tokenizer, placement)
    middlewares: list[Any] = [_errors_middleware]
    if router.tracing is not None:  # outermost: the request's span sees the answer's status
        middlewares.insert(0, trace_middleware(router.tracing, router.decision_record))
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    if config.routers > 1:  # which replica answered (a client or the chaos bench can tell them apart)
        replica = str(os.getpid())

        async def name_replica(request: web.Request, response: web.StreamResponse) -> None:
            response.headers["X-Pdserve-Replica"] = replica

        app.on_response_prepare.append(name_replica)
    endpoints.add_routes(app, router.context())
    return app


def serve(config: RouterConfig) -> None:
    """Run the router until interrupted."""
    app = create_app(config)
    web.run_app(app, host=config.host, port=config.port, handler_cancellation=True, access_log=None,
                print=lambda msg: log.info(msg), shutdown_timeout=5.0, reuse_port=config.routers > 1)
