"""A simulated vLLM engine: continuous batching with chunked prefill and a prefix cache.

Each engine step takes every running decode (one token each) and fills the rest of the token budget with
prefill chunks, first come first served, the way vLLM v1 schedules. On a colocated worker a long prefill
therefore shares (and stretches) the steps of every decode running there; a prefill-only worker runs prefill
steps; a decode-only worker runs decode steps plus the one-token KV completion of requests handed over. An
elastic worker does all of these at once: the prefills of requests it runs whole or only prefills (split), the
decodes of requests it runs whole or received, all in the same steps (the colocated step-cost model)."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pdserve.conductor.cost_model import CostModel

from .traffic import Request


@dataclass
class Job:
    """A request's state on the simulator's side."""

    req: Request
    kind: str = ""  # "local" | "disaggregated"
    prefill_worker: str = ""
    decode_worker: str = ""
    cached: int = -1  # prompt tokens found in the prefill worker's cache (-1: not looked up yet)
    prefill_start_s: float | None = None  # when its first prefill chunk's step began
    computed: int = 0  # prompt tokens computed so far (beyond the cached ones)
    tokens: int = 0  # output tokens produced
    first_token_s: float | None = None
    last_token_s: float = 0.0
    done_s: float | None = None
    rejected: str = ""
    gaps: list[float] = field(default_factory=list)  # inter-token gaps (ITL samples)

    @property
    def prefill_left(self) -> int:
        return self.req.prompt_tokens - max(0, self.cached) - self.computed


@dataclass
class StepPlan:
    chunks: list[tuple[Job, int]]
    decodes: list[Job]
    seconds: float


def mixed_step_s(cost: CostModel, chunks: list[tuple[int, int]], batch: int, context: int) -> float:
    """One engine step: prefill chunks (new, cached) plus ``batch`` decodes over ``context`` tokens.

    Alone, a decode step costs decode_step_s; next to prefill chunks only its marginal part (the extra
    sequences and their KV reads) is added, since the weights are read once for the whole step."""
    pre = sum(cost.prefill_s(n, c) for n, c in chunks)
    if not batch:
        return pre
    dec = cost.decode_step_s(batch, context)
    if not chunks:
        return dec
    return pre + max(0.0, dec - cost.decode_step_s(1, 1))


class SimWorker:
    def __init__(self, wid: str, role: str, cost: CostModel, kv_capacity_tokens: int, chunk_tokens: int,
                 max_seqs: int, block_size: int) -> None:
        self.wid, self.role, self.cost = wid, role, cost
        self.kv_capacity_tokens = kv_capacity_tokens
        self.chunk_tokens, self.max_seqs, self.block_size = chunk_tokens, max_seqs, block_size
        self.waiting: deque[Job] = deque()  # prefills not finished (FCFS)
        self.incoming: deque[Job] = deque()  # handed-over requests waiting for KV room (decode role)
        self.running: list[Job] = []  # decoding
        self.cache: OrderedDict[int, None] = OrderedDict()  # prefix cache (block keys, LRU order)
        self.busy_until: float | None = None
        self.busy_s = 0.0
        self.steps = 0
        self.kv_used = 0  # tokens reserved by admitted requests (prompt + output)

    # ---- prefix cache ----
    def cached_prefix(self, keys: tuple[int, ...]) -> int:
        n = 0
        for k in keys:
            if k not in self.cache:
                break
            self.cache.move_to_end(k)
            n += 1
        return n * self.block_size

    def store(self, keys: tuple[int, ...]) -> tuple[list[int], list[int]]:
        """Insert blocks; return (stored, evicted) keys. The cache holds what free KV room allows."""
        stored = []
        for k in keys:
            if k in self.cache:
                self.cache.move_to_end(k)
            else:
                self.cache[k] = None
                stored.append(k)
        room = max(0, (self.kv_capacity_tokens - self.kv_used) // self.block_size)
        evicted = []
        while len(self.cache) > room and self.cache:
            evicted.append(self.cache.popitem(last=False)[0])
        return stored, evicted

    # ---- scheduling ----
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.incoming)

    def _need(self, job: Job, prefilling: bool) -> int:
        """KV tokens ``job`` reserves here: the prompt, plus its output where it also decodes (a split request's
        prefill worker hands the KV over after the prompt; on an elastic worker either can happen)."""
        decodes_here = not prefilling or job.kind != "disaggregated"
        return job.req.prompt_tokens + (job.req.output_tokens if decodes_here else 0)

    def _fits(self, job: Job, prefilling: bool = False) -> bool:
        return self.kv_used + self._need(job, prefilling) <= self.kv_capacity_tokens or (self.kv_used == 0)

    def plan_step(self) -> StepPlan | None:
        """What the next step runs, admitting handed-over requests and prefills while KV room lasts."""
        while self.incoming and len(self.running) < self.max_seqs and self._fits(self.incoming[0]):
            job = self.incoming.popleft()
            self.kv_used += job.req.prompt_tokens + job.req.output_tokens
            self.running.append(job)
        decodes = self.running[: self.max_seqs]
        budget = self.chunk_tokens - len(decodes)
        chunks: list[tuple[Job, int]] = []
        for job in self.waiting:
            if budget <= 0 or len(decodes) + len(chunks) >= self.max_seqs:
                break
            if job.cached < 0:  # first scheduled: look up the prefix, reserve KV
                if not self._fits(job, prefilling=True):
                    break
                job.cached = min(self.cached_prefix(job.req.block_keys), job.req.prompt_tokens - 1)
                self.kv_used += self._need(job, prefilling=True)
            n = min(job.prefill_left, budget)
            chunks.append((job, n))
            budget -= n
        if not chunks and not decodes:
            return None
        ctx = sum(j.req.prompt_tokens + j.tokens for j in decodes)
        secs = mixed_step_s(self.cost, [(n, max(0, j.cached) + j.computed) for j, n in chunks], len(decodes), ctx)
        return StepPlan(chunks, decodes, secs)

    def release(self, job: Job, with_output: bool = True) -> None:
        self.kv_used -= job.req.prompt_tokens + (job.req.output_tokens if with_output else 0)
