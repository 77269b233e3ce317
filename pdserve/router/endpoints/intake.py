"""The one front door: every endpoint's request becomes a parsed request, its choices (one :class:`Generation` per
choice) and a run here, under one admission and one set of metrics.

An endpoint reads and parses its body, then::

    async with intake.admitted("chat") as visit:          # 429 past --max-inflight, before the body is read
        req = parse_chat(parse_json(await intake.read_body(request)))
        visit.choices = await intake.start(req, request, body, visit)
        ...                                                # answer; visit.done = True once answered in full

:meth:`Intake.check` holds every per-request check that is not a field's own (the model and its adapter, prompt
scoring with LoRA, the timings header): a new one goes there, and every endpoint gets it. :meth:`choices` turns a
request into its choices: each prompt tokenized (``api/prompt.py``), its length checked (:meth:`limits`) and one
``Generation`` built per choice (``n`` per prompt) with the data plane's options.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from aiohttp import web

from ..admission import Admission
from ..api.limits import read_body
from ..api.logprobs import LogprobTrack
from ..api.model_catalog import ModelCatalog
from ..api.prompt import prompt_chars, prompt_ids, rendered_chat
from ..api.protocol import GenerationRequest, clamped_max_tokens, parse_chat, parse_completion
from ..api.tokenizer import PromptTokenizer
from ..api.tools import ToolSupport
from ..api.truncation import truncated_max_tokens
from ..config import RouterConfig
from ..errors import RouterError, bad_request
from ..fleet.placement import ConductorPlacement, Placement
from ..fleet.sidecar import SidecarPlacement, pair_for
from ..metrics import RouterMetrics
from ..run.beam_search import BeamSearch
from ..run.choices import Choice, choice_seed, sum_usage
from ..run.generation import Generation, GenerationOptions
from ..run.kv_protocol import KVProtocol
from ..run.timings import Timings
from ..tracing import current, traced_placement
from ..workers.session import WorkerSession
from .decision_header import CHOICES_KEY, wants_record

TIMINGS_HEADER = "X-Pdserve-Timings"
OFFLOAD_CHARS = 16384  # tokenize prompts longer than this in a thread, keeping the event loop responsive
# the fields that make a body's prompt: what the router reads of a beam search request to place it
PROMPT_FIELDS = {"completions": ("prompt", "add_special_tokens"),
                 "chat": ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                          "tools", "documents", "add_special_tokens")}


@dataclass
class Visit:
    """One request at the door: its endpoint, timings and choices, and the status label its metrics get."""

    endpoint: str
    t: Timings
    status: str = "200"
    choices: list[Choice] = field(default_factory=list)
    done: bool = False  # answered in full: its timings and tokens count


class Intake:
    """What every endpoint shares: admission, metrics, the per-request checks and the choice builder."""

    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer, models: ModelCatalog, tools: ToolSupport,
                 metrics: RouterMetrics, placement: Placement, kv_protocol: KVProtocol,
                 workers: WorkerSession) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.models = models
        self.tools = tools
        self.metrics = metrics
        self.admission = Admission(config.max_inflight, metrics)
        self.placement = placement
        self.kv_protocol = kv_protocol  # the data plane's P -> D hand-off (Mooncake's keeps P's engine ids)
        self.workers = workers
        self.beam = BeamSearch(placement, workers.started, self.beam_prompt_ids,  # use_beam_search: one worker
                               config.request_timeout_s)

    # ---- admission and metrics ----
    @asynccontextmanager
    async def admitted(self, endpoint: str) -> AsyncIterator[Visit]:
        """Hold one admission slot (429 past --max-inflight) and count the request by endpoint and status; a
        visit answered in full (``visit.done``) with status 200 adds its phase timings and tokens."""
        visit = Visit(endpoint, Timings(arrive=time.perf_counter(), mode=self.config.mode))
        m = self.metrics
        m.inflight.inc()
        admitted = False
        try:
            admitted = self.admission.enter()
            yield visit
        except RouterError as e:
            visit.status = str(e.status)
            raise
        except asyncio.CancelledError:
            visit.status = "client_disconnected"
            raise
        finally:
            if admitted:
                self.admission.leave()
            m.inflight.dec()
            m.requests.labels(endpoint, visit.status).inc()
            self._count(visit)

    def _count(self, visit: Visit) -> None:
        t = visit.t
        if t.end is None:
            t.end = time.perf_counter()
        if visit.done and visit.status == "200":
            self.metrics.observe_timings(t.mode, t.report())
            prompt_tokens, completion_tokens = sum_usage(visit.choices)
            self.metrics.prompt_tokens.inc(prompt_tokens)
            self.metrics.completion_tokens.inc(completion_tokens)

    async def read_body(self, request: web.Request) -> bytes:
        """The body, within --max-body-bytes (413 past it)."""
        return await read_body(request, self.config.max_body_bytes)

    # ---- checks ----
    def check(self, req: GenerationRequest, request: web.Request) -> None:
        """The per-request checks every endpoint's request gets once parsed: the timings header, ``model``
        (404 for an unknown model; an adapter sets ``req.lora``, which P and D run) and prompt scoring, which
        crashes vLLM 0.32's engine with LoRA."""
        if request.headers.get(TIMINGS_HEADER, "").lower() in ("1", "true", "yes"):
            req.timings = True
        req.lora = self.models.adapter(req.model)
        if self.config.prefiller_header:  # a gateway's decode sidecar: the picker's pair (fleet/sidecar.py)
            req.gateway_pair = pair_for(request.headers, self.placement.registry, self.config.decode[0])
            self.metrics.sidecar_pairs.labels(req.gateway_pair.outcome).inc()
        self.models.refuse_prompt_scoring(req.prompt_logprobs, req.echo, req.logprobs)

    async def start(self, req: GenerationRequest, request: web.Request, body: dict[str, Any], visit: Visit
                    ) -> list[Choice]:
        """Check the request, prepare its tools (from the body's ``messages``) and build its choices (the run
        starts when their output is read)."""
        self.check(req, request)
        self.workers.started()
        tool_req = self.tools.prepare(req, body.get("messages")) if req.tools else None
        visit.choices = await self.choices(req, visit.t)
        if tool_req is not None:
            for c in visit.choices:
                c.tools = tool_req.calls()
        if wants_record(request):  # X-Pdserve-Decision: the answer's headers carry the record (.decisions)
            request[CHOICES_KEY] = (req.request_id, visit.choices)
        rt = current()
        if rt is not None:  # the request is traced: its admission span ends here
            rt.admitted(req.request_id, len(visit.choices), sum(len(c.prompt_ids) for c in visit.choices))
        return visit.choices

    async def beam_prompt_ids(self, kind: str, body: dict[str, Any]) -> list[int]:
        """A beam search body's (first) prompt as token ids, for its placement; [] when the router cannot read
        it (the worker it goes to answers for the body, in vLLM's words)."""
        part = {k: body[k] for k in PROMPT_FIELDS[kind] if k in body}
        try:
            req = parse_chat(part) if kind == "chat" else parse_completion(part)
            if req.prompts:
                first = req.prompts[0]
                req = replace(req, prompts=None, prompt_text=first if isinstance(first, str) else None,
                              prompt_ids=None if isinstance(first, str) else first)
            return await self.prompt_ids(req)
        except (RouterError, ValueError, TypeError):
            return []

    # ---- choices ----
    async def prompt_ids(self, req: GenerationRequest) -> list[int]:
        """api/prompt.py's ids, tokenized in a thread for a long prompt (the event loop stays responsive)."""
        fn = partial(prompt_ids, self.tokenizer, req, self.config.max_model_len)
        if prompt_chars(req) > OFFLOAD_CHARS:
            return await asyncio.get_running_loop().run_in_executor(None, fn)
        return fn()

    def limits(self, req: GenerationRequest, n: int) -> int:
        """The output budget of a prompt of ``n`` tokens, as vLLM 0.32 sets it: ``max_tokens`` over ``max_model_len``
        refused, else clamped to the room the prompt leaves; 400 when the prompt is empty or leaves no room."""
        limit = self.config.max_model_len
        if req.max_tokens is not None and req.max_tokens > limit:  # vLLM's TokenizeParams, before any truncation
            raise bad_request(f"{req.max_tokens_field}={req.max_tokens} cannot be greater than max_model_len={limit}. "
                              "Please request fewer output tokens.", req.max_tokens_field)
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
        return clamped_max_tokens(req, limit - n)

    async def choices(self, req: GenerationRequest, t: Timings) -> list[Choice]:
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
            ids = await self.prompt_ids(one)
            max_tokens = self.limits(req, len(ids))
            if req.kind == "chat":
                prompt_text = rendered_chat(self.tokenizer, one) if req.return_prompt_text else ""
            elif not req.echo:
                prompt_text = ""
            elif isinstance(prompt, str):
                prompt_text = prompt
            else:
                prompt_text = self.tokenizer.decode(ids)
            for j in range(req.n):
                index = len(out)
                sub = req
                if len(prompts) * req.n > 1:
                    sampling = dict(req.sampling)
                    if "seed" in sampling:
                        sampling["seed"] = choice_seed(sampling["seed"], j)
                    sub = replace(req, request_id=f"{req.request_id}-{index}", sampling=sampling)
                timings = t if index == 0 else Timings(arrive=t.arrive, mode=self.config.mode)
                gen = self.generation(sub, ids, max_tokens, timings)
                track = (None if req.logprobs is None or not req.token_details  # the workers still check them
                         else LogprobTrack(req.kind == "chat", req.logprobs, self.tokenizer.decode_one))
                out.append(Choice(index, k, gen, ids, prompt_text, track))
        if len(out) == 1 and req.stream and not req.continuous_usage and req.logprobs is None and not req.tools \
                and req.token_details:
            out[0].gen.passthrough = True  # per-token transform not needed: plain events relayed (run/relay.py)
        return out

    def generation(self, req: GenerationRequest, ids: list[int], max_tokens: int, t: Timings) -> Generation:
        """One choice's run, with the data plane's options (constrained output: D regenerates the first token so
        its grammar state covers the whole output)."""
        client = self.workers.started()
        detok = None
        if self.config.mode != "colocated":
            detok = self.tokenizer.detokenizer(ids, req.sampling.get("skip_special_tokens", True),
                                               req.sampling.get("spaces_between_special_tokens", True))
        options = GenerationOptions(**self.kv_protocol.options(constrained=req.constrained),
                                    migration_limit=self.config.migration_limit,
                                    request_timeout_s=self.config.request_timeout_s,
                                    handoff_timeout_s=self.config.handoff_timeout_s,
                                    probe_timeout_s=self.config.health_timeout_s)
        placement: Placement = self.placement
        if req.gateway_pair is not None and isinstance(self.placement, ConductorPlacement):
            placement = SidecarPlacement(self.placement, req.gateway_pair)  # first round on the picker's pair
        return Generation(req, ids, max_tokens, traced_placement(placement), client, self.metrics, t,
                          self.config.mode, detok, options)
