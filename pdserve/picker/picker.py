"""The endpoint picker's placement: the router's own (registry, conductor, KV event feed, load probe) without
its HTTP front. One decision per request; the gateway then sends the request to the chosen worker.

Pickers run active-active: each replica follows every worker's KV events and reads every worker's load itself,
seeds its index from the shared indexer (``--indexer``: docs/indexer.md) when it starts, and counts what a worker
reports beyond its own placements as the other replicas' load (``replicas`` > 1, as router replicas do). No
replica leads, none waits on another, and any may die: the gateway retries another (its ``failureMode``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from ..conductor import ConductorConfig
from ..kube.discovery import PoolTarget
from ..router.api.tokenizer import PromptTokenizer
from ..router.config import RouterConfig, check_kv_publisher, kv_bytes_per_token
from ..router.errors import RouterError
from ..router.fleet.index_seed import seed_from_indexer
from ..router.fleet.kv_events import KVEventFeed, Publisher, default_publisher
from ..router.fleet.load_probe import read_worker_load
from ..router.fleet.placeholders import ExpectingIndex, PlaceholderSync
from ..router.fleet.placement import make_placement
from ..router.fleet.registry import WorkerRegistry
from ..router.fleet.ticket import PlacementTicket
from ..router.workers.client import Worker, WorkerClient
from ..settings.targets import handed_on
from .discovery import RegistryMembership, follow_dns

log = logging.getLogger("pdserve.picker")


def host_port(url: str, port: int = 0) -> str:
    """``http://10.0.0.5:8000`` -> ``10.0.0.5:8000`` (the form the gateway's destination header takes); ``port``:
    that port on the worker's host instead of its own (0: its own)."""
    u = urlsplit(url)
    host = f"[{u.hostname}]" if u.hostname and ":" in u.hostname else u.hostname
    return f"{host}:{port or u.port or (443 if u.scheme == 'https' else 80)}"


def bad(message: str) -> RouterError:
    return RouterError(400, message, "invalid_request_error", None, "invalid_body")


class Picker:
    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer | None = None,
                 dns: tuple[PoolTarget, ...] = (), discovery_interval_s: float = 5.0) -> None:
        self.config = config
        self.dns, self.discovery_interval_s = dns, discovery_interval_s
        self.registry = WorkerRegistry(config.all_workers())
        self.placement = make_placement(self.registry, ConductorConfig(**handed_on(config, "conductor")),
                                        kv_bytes_per_token(config.model_dir))
        self.conductor = self.placement.conductor
        self.tokenizer = tokenizer or PromptTokenizer(config.model_dir)
        self.publishers: dict[str, Publisher] = {}
        for entry in config.kv_events:
            url, endpoint, replay = check_kv_publisher(entry)
            self.publishers[url] = Publisher(endpoint, replay)
        self.events: KVEventFeed | None = None
        self.placeholders: PlaceholderSync | None = None  # with --indexer: every replica's placements, shared
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.decision_seconds: deque[float] = deque(maxlen=100_000)
        self.decisions = 0
        self.cached_tokens = 0  # prompt tokens the chosen workers held (or loaded), over every decision

    async def start(self) -> None:
        self.session = aiohttp.ClientSession()
        if self.config.policy == "conductor":
            index = ExpectingIndex(self.conductor) if self.config.indexer else None
            self.events = KVEventFeed(index or self.conductor, self.config.block_size)
            mine = {w.url: self.publishers[w.url] for w in self.registry if w.url in self.publishers}
            if self.config.indexer and index is not None:
                await seed_from_indexer(self.session, self.config.indexer, self.events, index, mine)
                # placements as placeholders through the indexer, as router replicas share theirs
                self.placeholders = PlaceholderSync(self.config.indexer, self.session, index)
                self.placement.on_placed.append(self.placeholders.placed)
                self.placeholders.start()
            self.registry.subscribe(self)  # follows every worker's events, those discovery adds later too
        self._tasks.append(asyncio.create_task(self._load_loop()))
        if self.dns:
            self._tasks.append(asyncio.create_task(follow_dns(RegistryMembership(self.registry), self.dns,
                                                                     self.discovery_interval_s)))
        if self.config.health_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._health_loop()))

    # ---- RegistryListener: the KV event feed follows each worker while it is registered ----
    def worker_added(self, worker: Worker) -> None:
        pub = self.publishers.get(worker.url) or default_publisher(worker.url, self.config.kv_events_port)
        if self.events is not None and pub is not None:
            self.events.follow(worker.url, pub)

    def health_changed(self, worker: Worker) -> None:
        pass

    def worker_removed(self, url: str) -> None:
        if self.events is not None:
            self.events.forget(url)

    async def _health_loop(self) -> None:
        """Every worker's /health, as the router probes it: a worker refusing connections leaves the picker's
        candidates at once, a slow one after ``probe_failures`` failures, and comes back when it answers."""
        assert self.session is not None
        client = WorkerClient(self.session, self.config.connect_timeout_s, self.config.upstream_idle_timeout_s)
        while True:
            workers = list(self.registry)
            probes = await asyncio.gather(*(client.check(w.url, self.config.health_timeout_s) for w in workers))
            for w, probe in zip(workers, probes):
                self.registry.report_probe(w.url, probe)
            await asyncio.sleep(self.config.health_interval_s)

    async def _load_loop(self) -> None:
        assert self.session is not None
        while True:
            workers = list(self.registry)
            reports = await asyncio.gather(*(read_worker_load(self.session, w.url, self.config.health_timeout_s)
                                             for w in workers))
            for w, r in zip(workers, reports):
                if r is not None:
                    self.conductor.report_load(w.url, r.waiting, r.running, r.kv_usage, r.kv_capacity_tokens)
            self.conductor.expire_reports()
            await asyncio.sleep(self.config.load_interval_s)

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The request's prompt as token ids: ``prompt`` (text or ids, /v1/completions) or ``messages`` (chat,
        through the model's template). The gateway's body is the client's OpenAI request."""
        if "messages" in body:
            msgs = body["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise bad("'messages' must be a list of message objects")
            return self.tokenizer.chat_ids(msgs)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise bad("the body needs 'prompt' (text or token ids) or 'messages'")

    def pick(self, raw: bytes, subset: Sequence[str] | None = None, destination_port: int = 0) -> PlacementTicket:
        """Place the request whose body is ``raw``; RouterError 400 / 429 / 503 when it cannot be placed.
        ``subset``: the endpoints (``HOST:PORT``, as the destination names them with ``destination_port``) the
        gateway allows for this request (the extension's subset hint); a worker that would be the destination and
        is not among them is not chosen, and none left is a 503."""
        try:
            body = json.loads(raw)
        except ValueError:
            raise bad("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        max_tokens = 16 if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise bad("'max_tokens' must be a positive integer")
        ids = self.prompt_ids(body)
        t0 = time.perf_counter()
        exclude = self._outside(subset, destination_port) if subset is not None else frozenset()
        ticket = self.placement.choose(ids, exclude=exclude, max_tokens=max_tokens)
        if subset is not None and host_port(ticket.decode.url, destination_port) not in subset:
            ticket.close()  # no allowed worker left: the conductor fell back to one the gateway did not list
            raise RouterError(503, "no endpoint of the gateway's subset can serve the request", "server_error",
                              None, "no_endpoint_in_subset")
        self.decision_seconds.append(time.perf_counter() - t0)
        self.decisions += 1
        self.cached_tokens += ticket.decision.cached_tokens
        return ticket

    def _outside(self, subset: Sequence[str], destination_port: int) -> frozenset[str]:
        """The workers that would be a destination (any that decodes: decode or elastic roles) outside ``subset``."""
        allowed = set(subset)
        return frozenset(w.url for w in self.registry
                         if w.roles - {"prefill"} and host_port(w.url, destination_port) not in allowed)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        if self.placeholders is not None:
            await self.placeholders.close()
        if self.events is not None:
            await self.events.close()
        if self.session is not None:
            await self.session.close()
