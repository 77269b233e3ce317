"""The router's HTTP server (aiohttp): the one public port.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming and not), POST /v1/messages and
/v1/responses (run as chat requests: :mod:`.api.messages`, :mod:`.api.responses`), POST /tokenize and /detokenize
(:mod:`.tokenize_api`), GET /v1/models and POST /v1/load_lora_adapter, /v1/unload_lora_adapter (the served
model and its LoRA adapters: :mod:`.api.lora`), GET /health (200 only when every configured worker answers its /health),
GET /ready (200 while a healthy worker can serve requests end to end, "degraded" with one role gone: the
Kubernetes readiness probe), GET /metrics (Prometheus text), and worker membership: GET/POST/DELETE
/v1/pdserve/workers (admin token or loopback only); GET /openapi.json describes them.
Input limits (body size, JSON nesting, prompt length) are in :mod:`.limits`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web

from ..conductor import ConductorConfig
from ..conductor.moves import MoveConfig
from ..http_probe import PID_HEADER
from ..settings.lora import parse_lora_modules
from ..settings.targets import handed_on
from .admission import Admission
from .api import messages, responses
from .api.limits import body_too_large, read_body
from .api.logprobs import LogprobTrack
from .api.lora import LoraAdmin, ModelCatalog
from .api.lora import add_routes as add_lora_routes
from .api.openapi import openapi_document
from .api.prompt import prompt_chars, prompt_ids
from .api.protocol import GenerationRequest, parse_chat, parse_completion, parse_json
from .api.response import ResponseBuilder
from .api.stream_refusal import refusal
from .api.tokenize_api import add_routes as add_tokenize_routes
from .api.tokenizer import PromptTokenizer
from .api.tools import ToolSupport
from .api.truncation import truncated_max_tokens
from .config import RouterConfig, check_kv_publisher, kv_bytes_per_token
from .errors import RouterError, bad_request
from .fleet.adapter_sync import AdapterSync
from .fleet.calibration import calibrate
from .fleet.kv_events import KVEventFeed, Publisher, default_publisher
from .fleet.load_probe import read_worker_load
from .fleet.membership import Membership
from .fleet.mooncake_store import MooncakeStoreFollower
from .fleet.placement import ConductorPlacement, Placement, make_placement
from .fleet.pool_index import PoolIndexFollower
from .fleet.registry import WorkerRegistry
from .fleet.shared_adapters import AdapterFile
from .fleet.shared_membership import MembershipFile
from .fleet.workers import Worker, WorkerClient
from .metrics import ConductorCollector, RouterMetrics
from .run.answer import collect, stream
from .run.chat_bridge import ChatBridge
from .run.choices import Choice, choice_seed, sum_usage
from .run.generation import Generation, RunOptions, Timings
from .run.kv_protocol import protocol_for

log = logging.getLogger("pdserve.router")

TIMINGS_HEADER = "X-Pdserve-Timings"
ROUTER_KEY: web.AppKey[Router] = web.AppKey("router")
OPENAPI_KEY: web.AppKey[dict] = web.AppKey("openapi")
_OFFLOAD_CHARS = 16384  # tokenize prompts longer than this in a thread, keeping the event loop responsive


class Router:
    """State shared by the handlers of one app."""

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
        self.admission = Admission(config.max_inflight, self.metrics)
        # the data plane's P -> D hand-off (Mooncake's keeps P's engine ids: one per app)
        self.kv_protocol = protocol_for(config.kv_connector, config.mooncake_bootstrap_port, config.mooncake_bootstrap)
        self.session: aiohttp.ClientSession | None = None
        self.client: WorkerClient | None = None
        self._health_task: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self.events: KVEventFeed | None = None
        # each worker's KV event publisher (--kv-events, or given when it joins through the membership API)
        self.publishers: dict[str, Publisher] = {}
        for entry in config.kv_events:
            url, endpoint, replay = check_kv_publisher(entry)
            self.publishers[url] = Publisher(endpoint, replay)
        self.shared: MembershipFile | None = None  # run-time membership shared with the other replicas
        if config.membership_file:
            self.shared = MembershipFile(config.membership_file, self.registry, self.publishers)
        self.pool: PoolIndexFollower | MooncakeStoreFollower | None = None  # what the KV pool holds
        self.calibration: dict | None = None
        self.created = int(time.time())
        # the served model and its LoRA adapters: the names ``model`` may take (api/lora.py)
        self.models = ModelCatalog(config.served_model_name, config.model_dir, config.max_model_len, self.created,
                                   parse_lora_modules(config.lora_modules), config.enable_lora)
        # a worker back without its adapters gets them again (checked in each health probe)
        self.adapter_sync = AdapterSync(self.models, lambda: self.session, config.health_timeout_s)
        self.shared_adapters: AdapterFile | None = None  # the adapter list shared with the other replicas
        if self.shared is not None and self.models.lora:
            self.shared_adapters = AdapterFile(self.shared.file, self.models)
        self.tools = ToolSupport(config.tool_call_parser, self.tokenizer.tok, config.served_model_name)
        self.registry.subscribe(self)
        if self.conducted is not None:
            self.metrics.registry.register(ConductorCollector(
                self.conducted, lambda: self.events.batches if self.events is not None else {}))

    @property
    def conducted(self) -> ConductorPlacement | None:
        return self.placement if isinstance(self.placement, ConductorPlacement) else None

    # ---- RegistryListener: the KV event feed follows each worker's publisher while the worker is registered ----
    def worker_added(self, worker: Worker) -> None:
        publisher = self.publishers.get(worker.url) or default_publisher(worker.url, self.config.kv_events_port)
        if self.events is not None and publisher is not None:
            self.events.follow(worker.url, publisher)

    def health_changed(self, worker: Worker) -> None:
        pass

    def worker_removed(self, url: str) -> None:
        if self.events is not None:
            self.events.forget(url)

    # ---- lifecycle ----
    async def start(self, app: web.Application) -> None:
        _ = self.tokenizer.chars_per_token  # the prompt-length bound reads the vocabulary once, before any request
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.client = WorkerClient(self.session, self.config.connect_timeout_s, self.config.upstream_idle_timeout_s)
        if self.config.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop())
        for shared in (self.shared, self.shared_adapters):  # before the KV event feed: it follows the file's workers
            if shared is not None:
                shared.start()
                self._tasks.append(asyncio.create_task(shared.follow()))
        cp = self.conducted
        if cp is not None and self.config.policy != "round_robin":
            self.events = KVEventFeed(cp.conductor, self.config.block_size, self.config.kv_events_bind)
            if self.events.endpoint:
                log.info("KV event sink on %s", self.events.endpoint)
            for w in self.registry:
                self.worker_added(w)
            if self.config.pool_master and self.config.policy == "conductor":
                self.pool = PoolIndexFollower(self.config.pool_master, self.config.pool_secret, cp.conductor)
            elif self.config.mooncake_store and self.config.policy == "conductor":
                store = MooncakeStoreFollower(self.config.mooncake_store, self.config.model_dir, cp.conductor)
                self.events.learners.append(store.learn)  # the store's keys are vLLM's hashes: the events map them
                self.pool = store
            self._tasks.append(asyncio.create_task(self._load_loop(cp)))
            if self.config.calibrate and self.config.policy == "conductor":
                self._tasks.append(asyncio.create_task(self._calibrate(cp)))
        if self.config.tool_call_parser:  # import vLLM's parser off the event loop, before the first tool request
            self._tasks.append(asyncio.create_task(self._load_tool_parser()))

    async def _load_tool_parser(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.tools.parser_cls)
        except RouterError as e:
            log.error("--tool-call-parser: %s", e.message)

    async def stop(self, app: web.Application) -> None:
        for task in [self._health_task, *self._tasks]:
            if task is None:
                continue
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self.events is not None:
            await self.events.close()
        if self.pool is not None:
            await self.pool.close()
        if self.session is not None:
            await self.session.close()

    async def _load_loop(self, cp: ConductorPlacement) -> None:
        """Read every worker's /metrics (queue, running, KV usage and capacity) into the conductor."""
        assert self.session is not None
        while True:
            workers = list(self.registry)
            reports = await asyncio.gather(*(read_worker_load(self.session, w.url, self.config.health_timeout_s)
                                             for w in workers))
            for w, r in zip(workers, reports):
                if r is not None:
                    cp.conductor.report_load(w.url, r.waiting, r.running, r.kv_usage, r.kv_capacity_tokens)
            cp.conductor.expire_reports()
            await asyncio.sleep(self.config.load_interval_s)

    async def _calibrate(self, cp: ConductorPlacement) -> None:
        assert self.client is not None
        try:
            self.calibration = await calibrate(self.client, cp.conductor, list(self.registry),
                                               self.tokenizer.vocab_size, self.config.max_model_len)
        except Exception:
            log.exception("start-up calibration failed; the cost model keeps its defaults")

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.probe()
            except Exception:  # never let the loop die
                log.exception("health probe failed")
            await asyncio.sleep(self.config.health_interval_s)

    async def probe(self) -> list[dict[str, Any]]:
        assert self.client is not None
        workers = list(self.registry)
        results = await asyncio.gather(*(self.client.check(w.url, self.config.health_timeout_s) for w in workers))
        lacking = await asyncio.gather(*(self.adapter_sync.ensure(w.url) if p.ok else _none()
                                         for w, p in zip(workers, results)))
        out = []
        for w, probe, why in zip(workers, results, lacking):
            if why is not None:  # it answers, but lacks adapters the router lists (fleet/adapter_sync.py)
                self.registry.set_health(w.url, False, why)
            else:
                self.registry.report_probe(w.url, probe)  # a slow answer alone does not take a worker out
            for role in sorted(w.roles):
                self.metrics.worker_healthy.labels(role, w.url).set(1.0 if w.healthy else 0.0)
            out.append({"url": w.url, "roles": sorted(w.roles), "healthy": probe.ok and why is None,
                        "detail": why or probe.detail, "serving": w.healthy})
        return out

    # ---- handlers ----
    async def health(self, request: web.Request) -> web.Response:
        workers = await self.probe()
        ok = all(w["healthy"] for w in workers)
        return web.json_response({"status": "ok" if ok else "unhealthy", "mode": self.config.mode,
                                  "workers": workers}, status=200 if ok else 503,
                                 headers={PID_HEADER: str(os.getpid())})  # which replica answered

    async def ready(self, request: web.Request) -> web.Response:
        """200 while some healthy worker can serve a request end to end (from the last probes): "ready" with a
        healthy worker of each role, "degraded" with one role gone (P decodes locally, or D prefills locally;
        ``missing`` names the role), 503 "not ready" with none. Unlike /health, a dead worker of several does not
        make the router unready."""
        healthy = self.registry.healthy()
        need = (("colocated",),) if self.config.mode == "colocated" else (("prefill",), ("decode",))
        missing = [r[0] for r in need if not any(set(r) & w.roles for w in healthy)]
        serving = bool(healthy) and len(missing) < len(need)
        status = "ready" if not missing else "degraded" if serving else "not ready"
        body: dict[str, Any] = {"status": status, "mode": self.config.mode,
                                "healthy_workers": len(healthy), "workers": len(self.registry)}
        if missing:
            body["missing"] = missing
        return web.json_response(body, status=200 if serving else 503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        text = self.metrics.render()
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response(self.models.listing())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    # ---- generation ----
    async def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        """api/prompt.py's ids, tokenized in a thread for a long prompt (the event loop stays responsive)."""
        fn = partial(prompt_ids, self.tokenizer, req, self.config.max_model_len)
        if prompt_chars(req) > _OFFLOAD_CHARS:
            return await asyncio.get_running_loop().run_in_executor(None, fn)
        return fn()

    def _limits(self, req: GenerationRequest, n: int) -> int:
        limit = self.config.max_model_len
        if req.truncation is not None:  # vLLM's budget for a truncated prompt (api/truncation.py)
            return truncated_max_tokens(n, req.max_tokens, limit)
        if n == 0:
            raise bad_request("the prompt is empty after tokenization", "prompt" if req.kind != "chat" else "messages")
        if n >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                              f"{n} tokens, leaving no room for output. Please reduce the length of the prompt.",
                              "messages" if req.kind == "chat" else "prompt", "context_length_exceeded")
        if req.max_tokens is None:
            return limit - n
        if n + req.max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{n + req.max_tokens} tokens ({n} in the prompt, {req.max_tokens} for the completion). "
                              "Please reduce the length of the prompt or max_tokens.", req.max_tokens_field,
                              "context_length_exceeded")
        return req.max_tokens

    async def _generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        t = Timings(arrive=time.perf_counter(), mode=self.config.mode)
        m = self.metrics
        m.inflight.inc()
        status = "200"
        done = False
        admitted = False
        choices: list[Choice] = []
        streamed = False
        try:
            admitted = self.admission.enter()  # 429 past --max-inflight, before the body is read
            body = parse_json(await read_body(request, self.config.max_body_bytes))
            req = parse_chat(body) if endpoint == "chat" else parse_completion(body)
            streamed = req.stream
            if request.headers.get(TIMINGS_HEADER, "").lower() in ("1", "true", "yes"):
                req.timings = True
            req.lora = self.models.adapter(req.model)  # 404 for an unknown model; P and D run the adapter
            self.models.refuse_prompt_scoring(req.prompt_logprobs, req.echo, req.logprobs)
            assert self.client is not None, "router not started"
            tool_req = self.tools.prepare(req, body.get("messages")) if req.tools else None
            choices = await self._choices(req, t)
            if tool_req is not None:
                for c in choices:
                    c.tools = tool_req.calls()
            builder = ResponseBuilder(req, self.models.answer_name(req.lora))
            if req.stream:
                resp, status = await stream(request, req, choices, builder, self.tokenizer.decode_one)
            else:
                resp = await collect(req, choices, builder, self.tokenizer.decode_one)
            done = True
            return resp
        except RouterError as e:
            status = str(e.status)
            return refusal(e, streamed)  # a JSON error, or vLLM's in-stream refusal of a streamed request
        except asyncio.CancelledError:
            status = "client_disconnected"
            raise
        finally:
            if admitted:
                self.admission.leave()
            m.inflight.dec()
            m.requests.labels(endpoint, status).inc()
            if t.end is None:
                t.end = time.perf_counter()
            if done and status == "200":
                m.observe_timings(t.mode, t.report())
                prompt_tokens, completion_tokens = sum_usage(choices)
                m.prompt_tokens.inc(prompt_tokens)
                m.completion_tokens.inc(completion_tokens)

    async def _choices(self, req: GenerationRequest, t: Timings) -> list[Choice]:
        """Tokenize each prompt, check its length and build one Generation per choice (n per prompt)."""
        if not req.include_reasoning and self.config.tool_call_parser:
            req.token_details = False  # as a vLLM worker running a parser: ids and logprobs hidden, not the text
        bias = [int(k) for k in req.sampling.get("logit_bias", {})]
        for name, ids in (("stop_token_ids", req.stop_token_ids), ("logit_bias", bias),
                          ("allowed_token_ids", req.sampling.get("allowed_token_ids", [])),
                          ("logprob_token_ids", req.sampling.get("logprob_token_ids", []))):
            self.tokenizer.check_ids(ids, name)  # out-of-vocabulary ids: the 400 vLLM answers, naming the field
        prompts: list[str | list[int]] = req.prompts or [req.prompt_ids if req.prompt_ids is not None
                                                         else req.prompt_text or ""]
        out: list[Choice] = []
        for k, prompt in enumerate(prompts):
            one = req if req.prompts is None else replace(
                req, prompt_text=prompt if isinstance(prompt, str) else None,
                prompt_ids=None if isinstance(prompt, str) else prompt)
            prompt_ids = await self._prompt_ids(one)
            max_tokens = self._limits(req, len(prompt_ids))
            if req.kind == "chat" or not req.echo:
                prompt_text = ""
            elif isinstance(prompt, str):
                prompt_text = prompt
            else:
                prompt_text = self.tokenizer.decode(prompt_ids)
            for j in range(req.n):
                index = len(out)
                sub = req
                if len(prompts) * req.n > 1:
                    sampling = dict(req.sampling)
                    if "seed" in sampling:
                        sampling["seed"] = choice_seed(sampling["seed"], j)
                    sub = replace(req, request_id=f"{req.request_id}-{index}", sampling=sampling)
                timings = t if index == 0 else Timings(arrive=t.arrive, mode=self.config.mode)
                gen = self._generation(sub, prompt_ids, max_tokens, timings)
                track = (None if req.logprobs is None or not req.token_details  # the workers still check them
                         else LogprobTrack(req.kind == "chat", req.logprobs, self.tokenizer.decode_one))
                out.append(Choice(index, k, gen, prompt_ids, prompt_text, track))
        if len(out) == 1 and req.stream and not req.continuous_usage and req.logprobs is None and not req.tools \
                and req.token_details:
            out[0].gen.passthrough = True  # per-token transform not needed: plain events relayed (.relay)
        return out

    def _generation(self, req: GenerationRequest, prompt_ids: list[int], max_tokens: int, t: Timings
                    ) -> Generation:
        assert self.client is not None, "router not started"
        detok = None
        if self.config.mode != "colocated":
            detok = self.tokenizer.detokenizer(prompt_ids, req.sampling.get("skip_special_tokens", True),
                                               req.sampling.get("spaces_between_special_tokens", True))
        # the data plane's hand-off; constrained output: D regenerates the first token so its grammar state
        # covers the whole output
        options = RunOptions(**self.kv_protocol.options(constrained=req.constrained),
                             migration_limit=self.config.migration_limit,
                             request_timeout_s=self.config.request_timeout_s,
                             handoff_timeout_s=self.config.handoff_timeout_s,
                             probe_timeout_s=self.config.health_timeout_s)
        return Generation(req, prompt_ids, max_tokens, self.placement, self.client, self.metrics, t,
                          self.config.mode, detok, options)


async def _none() -> None:
    return None


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


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI_KEY])


def create_app(config: RouterConfig, tokenizer: PromptTokenizer | None = None,
               placement: Placement | None = None) -> web.Application:
    """The aiohttp app (serve it with handler_cancellation=True so client disconnects abort worker calls)."""
    router = Router(config, tokenizer, placement)
    app = web.Application(middlewares=[_errors_middleware], client_max_size=config.max_body_bytes)
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    if config.routers > 1:  # which replica answered (a client or the chaos bench can tell them apart)
        replica = str(os.getpid())

        async def name_replica(request: web.Request, response: web.StreamResponse) -> None:
            response.headers["X-Pdserve-Replica"] = replica

        app.on_response_prepare.append(name_replica)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat)
    app.router.add_get("/v1/models", router.list_models)
    if config.enable_lora:  # as vLLM, which serves them only with runtime LoRA updates allowed
        add_lora_routes(app, LoraAdmin(router.models, lambda: [w.url for w in router.registry],
                                       lambda: router.session, config.max_body_bytes))
    app.router.add_get("/health", router.health)
    app.router.add_get("/ready", router.ready)
    app.router.add_get("/metrics", router.metrics_handler)
    Membership(config, router.registry, router.placement, lambda: router.calibration, router.publishers,
               router.shared.changed if router.shared is not None else None).add_routes(app)
    app.router.add_get("/openapi.json", _openapi)
    bridge = ChatBridge(router.models, router.admission, router.metrics, router.tools, router._choices,
                        config.mode, config.max_body_bytes)
    # /v1/messages and /v1/responses run as chat requests (run/chat_bridge.py)
    messages.add_routes(app, bridge, router.tokenizer)
    responses.add_routes(app, bridge)
    add_tokenize_routes(app, router.tokenizer, router._prompt_ids, router.models, config.max_model_len,
                        config.max_body_bytes)
    app[OPENAPI_KEY] = openapi_document(config.served_model_name, config.max_model_len, config.max_body_bytes,
                                         router.tokenizer.vocab_size, bool(config.tool_call_parser))
    return app


def serve(config: RouterConfig) -> None:
    """Run the router until interrupted."""
    app = create_app(config)
    web.run_app(app, host=config.host, port=config.port, handler_cancellation=True, access_log=None,
                print=lambda msg: log.info(msg), shutdown_timeout=5.0, reuse_port=config.routers > 1)
