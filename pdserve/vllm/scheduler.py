"""The connector's scheduler half: decides per request what to lease (P), read (D) or load/save (KV pool),
and hands the plans to the worker half in :class:`PdserveMeta` every step.

No vLLM import: vLLM's Request, KVCacheBlocks, SchedulerOutput and KVConnectorOutput are duck-typed (the
attributes used are named where they are used), so unit tests drive this with small fakes.

P (request has ``do_remote_decode``): ``request_finished`` keeps the blocks (delay_free=True), returns where
they are, and tells its worker the lease deadline; the worker's :class:`~pdserve.vllm.release.ReleaseLedger`
reports them ``finished_sending`` later.

D (request has ``do_remote_prefill``): ``get_num_new_matched_tokens`` claims the prompt tokens its prefix cache
lacks, as a synchronous load when this rank's read is at most ``sync_load_max_bytes`` (vLLM schedules the
request at once; the worker reads before the step's forward, which computes the first token) or else as an
async load (the request waits in WAITING_FOR_REMOTE_KVS until the read is reported, a step later);
``update_state_after_alloc`` pairs D's new blocks with P's block ids into a :class:`RecvJob`.

KV pool: ``get_num_new_matched_tokens`` asks the pool master how many full blocks after the local hit are
pooled and ``update_state_after_alloc`` plans their load; ``request_finished`` plans a save of a finished
request's full blocks (holding them, delay_free, until written).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.hashing import ROOT_KEY, block_hashes, domain_root
from pdserve.store import ClientConfig, StoreClient, StoreError
from pdserve.vllm.continuation import CONTINUE, asks_to_continue, cannot_continue, continue_after
from pdserve.vllm.fingerprint import differences
from pdserve.vllm.groups import MAMBA, SLIDING, GroupSpec, flat, hand_off, is_hybrid, pair
from pdserve.vllm.logs import connector_log
from pdserve.vllm.messages import (
    PdserveHandshake,
    PdserveMeta,
    PdserveWorkerMeta,
    PoolJob,
    ReadyNote,
    RecvJob,
    merge_reads,
)
from pdserve.vllm.params import (
    HANDOFF_PREFIX,
    LAYERWISE,
    NO_EARLY,
    BlockPlan,
    ConnectorConfig,
    RemoteParams,
    known_test_fault,
    plan_blocks,
    prompt_hash,
    same_layout,
)
from pdserve.vllm.pool_groups import candidates, load_groups, longest, save_items
from pdserve.vllm.prefill_seals import PrefillSeals
from pdserve.vllm.read_signal import READ_SIGNAL
from pdserve.vllm.shards import ShardError, plan_slices
from pdserve.vllm.spans import traceparent_of
from pdserve.vllm.stamps import HandoffStamps

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = connector_log()

# RequestStatus names of a request that ran to its end (not aborted, not failed): only these hand off KV.
COMPLETED = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})
# P's kv_transfer_params key: false = lease only a prompt whose one-token prefill ended by length. A caller that
# streams P's first token and ends the request when P stops (the router's P -> D path) never asks a decode to
# continue a stopped one, so its blocks are freed at once instead of held until the lease ends. Absent (true):
# a stopped prefill is leased too, for a caller whose D regenerates the first token (structured outputs).
LEASE_ON_STOP = "lease_on_stop"
MAX_READ_STATS = 10000  # D reads whose stats wait for their request to finish (aborted ones never do)
EARLY_PACE_MS = 1.0  # D's empty steps while only early reads wait for P's prefill (worker in another process)


class PoolLookup(Protocol):
    def prefix(self, keys: Sequence[int]) -> int: ...

    def exists(self, keys: Sequence[int]) -> list[bool]: ...


def completed(request: Request) -> bool:
    return getattr(request.status, "name", None) in COMPLETED


def key_domain(request: Request) -> int:
    """The root of the request's pool keys: its cache salt and LoRA adapter (:func:`pdserve.hashing.domain_root`),
    as vLLM's own block hashes include them, so a request never loads blocks pooled under another salt."""
    lora = getattr(request, "lora_request", None)
    return domain_root(getattr(request, "cache_salt", None), getattr(lora, "lora_name", None))


def request_fingerprint(fingerprint: Mapping[str, str] | None, request: Request) -> dict[str, str] | None:
    """The worker's fingerprint with the request's key domain as ``domain`` ("" without a salt or an adapter): P
    sends it with its hand-off and D compares it with its own request's, so D never reads KV that P computed under
    another cache salt or LoRA adapter (it computes the prompt itself)."""
    if not fingerprint:
        return None
    root = key_domain(request)
    return {**fingerprint, "domain": "" if root == ROOT_KEY else f"{root:016x}"}


def pool_client(config: ConnectorConfig) -> StoreClient | None:
    addr = config.pool_address
    if addr is None:
        return None
    log.info("scheduler: KV pool master %s:%d (save %s, load %s)", addr[0], addr[1], config.pool_save,
             config.pool_load)
    return StoreClient(ClientConfig(addr[0], addr[1], secret=config.secret, timeout_s=config.pool_timeout_s))


class SchedulerSide:
    """One per vLLM engine, in the scheduler process. ``pool``: the KV pool master client (None = no pool)."""

    def __init__(self, config: ConnectorConfig, block_size: int, pool: PoolLookup | None = None,
                 tp: int = 1, prefix_caching: bool = True, groups: Sequence[GroupSpec] = ()) -> None:
        self.config = config
        self.block_size = block_size
        # the engine's own prefix caching (vLLM's cache_config): off, it never computes a prompt on top of KV it
        # holds, so neither may the connector make it: no pool, and P's KV only for the step after P's prompt
        self.prefix_caching = prefix_caching
        if pool is not None and not prefix_caching:
            log.warning("scheduler: this engine has prefix caching off (vLLM turns it off where it cannot compute "
                        "a prompt on top of cached KV, e.g. MLA on CPU); the KV pool is not used by this worker")
            pool = None
        # vLLM's KV cache groups (hybrid KV cache manager): a hand-off names blocks per group (pdserve.vllm.groups)
        self.groups = tuple(groups)
        self.hybrid = is_hybrid(self.groups)
        self.tp = tp  # tensor-parallel ranks of this engine: a read is done when every rank has reported it
        self.handshake: PdserveHandshake | None = None  # rank 0's
        self.ranks: list[PdserveHandshake] = []  # every rank's, by rank
        self._partial: OrderedDict[str, dict[str, Any]] = OrderedDict()  # D reads some ranks have reported
        self._held: set[str] = set()  # P requests whose lease has not ended (pacing only: any rank's end counts)
        self._matched: dict[str, int] = {}  # D request -> local hit tokens seen by get_num_new_matched
        self._sync: set[str] = set()  # D requests whose read get_num_new_matched chose to run synchronously
        self.stamps = HandoffStamps()  # D hand-offs' timestamps (one log line each)
        self._recv: list[RecvJob] = []
        self._send: dict[str, float] = {}
        self._send_trace: dict[str, str] = {}  # P request id -> traceparent, for the lease's span (traced only)
        self._seal: dict[str, tuple[int, ...]] = {}  # P: leased blocks whose checksums the worker computes
        self._faults: dict[str, str] = {}  # P: test faults for the worker (allow_test_faults)
        self.prefill_seals = PrefillSeals(block_size)  # P: seal the prompt's blocks right after its last forward
        self._unseal: list[str] = []  # P: early seals for the worker to forget
        # P, early hand-offs (the router sent D while P prefills): request id -> (hand-off id, its lease seconds),
        # followed until the step that completes the prompt, whose blocks the worker then announces to D
        self.prefill_ready = PrefillSeals(block_size)
        self._early: dict[str, tuple[str, float, bool]] = {}  # (hand-off id, lease seconds, D continues after t1)
        # P: notes of hand-offs whose D continues after P's first token (announced at the forward that completed the
        # prompt), kept until P sampled that token (request_finished): the note with it goes out again at the start
        # of the next step (None: no token to continue after), D's second answer
        self._held_notes: dict[str, ReadyNote] = {}
        self._announce_now: dict[str, ReadyNote | None] = {}
        self._requests: dict[str, Request] = {}  # those requests, until they finish
        self._announced: set[str] = set()  # P requests whose blocks D may be reading already: always leased
        self._ready: dict[str, ReadyNote | None] = {}
        self._early_reads: set[str] = set()  # D: early reads in flight (they wait for P's prefill)
        # D: requests that continue after P's first token once their read ends (pdserve.vllm.continuation)
        self._continuing: dict[str, Request] = {}
        self.continued = 0  # D: requests that continued after P's token (and did not regenerate it)
        # D request -> transfer stats for its response (bounded: aborted requests never collect theirs)
        self._reads: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.reading = 0  # D reads and pool loads in flight
        self.pool = pool
        # KV pool: request -> (block-aligned local hit, pooled keys after it) seen by get_num_new_matched
        self._pool_hits: dict[str, tuple[int, list[int]]] = {}
        self._pool_jobs: list[PoolJob] = []
        self._pool_saving: set[str] = set()
        self._pool_down_until = 0.0
        self.pool_outcomes: dict[str, int] = {}
        # requests whose pool load failed (in part): vLLM reschedules them, and the pool must not be claimed again
        # (a corrupt or foreign object stays pooled: claiming it again would loop)
        self._pool_refused: OrderedDict[str, None] = OrderedDict()

    def has_pending_announcements(self) -> bool:
        """P: hand-off answers (P's first token known, or the hand-off gone) that only the next step takes to the
        worker: vLLM must step even when nothing else is left (its request finished, nothing else queued)."""
        return bool(self._announce_now or self._ready)

    @property
    def held(self) -> int:
        """P requests whose lease has not ended (for pacing idle steps)."""
        return len(self._held)

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        """Every tensor-parallel rank's transfer engine, keyed by rank (vLLM: ``{tp_rank: metadata}``)."""
        ranks = [metadata[r] for r in sorted(metadata)]
        bad = [h for h in ranks if not isinstance(h, PdserveHandshake)]
        if bad or not ranks:
            raise ValueError(f"PdserveConnector expected PdserveHandshake from the workers, got {bad or metadata!r}")
        if len(ranks) != self.tp:
            log.warning("scheduler: %d tensor-parallel ranks but handshakes from ranks %s", self.tp, sorted(metadata))
        if len({h.layout for h in ranks}) > 1:
            raise ValueError(f"PdserveConnector: tensor-parallel ranks report different KV layouts "
                             f"{[h.layout for h in ranks]}")
        self.ranks, self.handshake = ranks, ranks[0]
        for h in ranks:
            log.info("scheduler: rank %d transfer engine %s at %s:%d, KV layout %s", h.rank, h.engine_id, h.host,
                     h.port, h.layout)

    # ---- KV pool ----
    def _pool_usable(self) -> bool:
        return self.pool is not None and time.monotonic() >= self._pool_down_until

    def _pool_failed(self, what: str, exc: Exception) -> None:
        self._pool_down_until = time.monotonic() + self.config.pool_backoff_s
        log.warning("KV pool %s failed (%s); not using the pool for %.0f s", what, exc, self.config.pool_backoff_s)

    def _pool_match(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the local hit whose blocks the pool holds (whole blocks, a chained prefix)."""
        self._pool_hits.pop(request.request_id, None)
        bs = self.groups[0].block_size if self.hybrid else self.block_size
        if (not self.config.pool_load or not self._pool_usable() or num_computed_tokens % bs
                or request.request_id in self._pool_refused):
            return 0, False
        keys = block_hashes(request.prompt_token_ids or [], bs, key_domain(request))
        first = num_computed_tokens // bs
        if self.hybrid:  # a hybrid prefix leaves vLLM at least one token to compute (its state must be exact)
            keys = keys[:(request.num_prompt_tokens - 1) // bs]
        if first >= len(keys):
            return 0, False
        try:
            n = self._pool_prefix(keys, first)
        except StoreError as exc:
            self._pool_failed("lookup", exc)
            return 0, False
        if n < self.config.pool_min_blocks:
            return 0, False
        self._pool_hits[request.request_id] = (num_computed_tokens, keys[:first + n] if self.hybrid
                                               else keys[first:first + n])
        return n * bs, True

    def _pool_prefix(self, keys: list[int], first: int) -> int:
        """Pooled blocks after the first ``first`` of ``keys``: a chained prefix, or for a hybrid cache the longest
        one whose every KV cache group is pooled as a continuation needs it (pdserve.vllm.pool_groups)."""
        assert self.pool is not None
        if not self.hybrid:
            return self.pool.prefix(keys[first:])
        asked = candidates(self.groups, keys, first)
        pooled = [k for k, ok in zip(asked, self.pool.exists(asked)) if ok]
        end = longest(self.groups, keys, first, pooled)
        return end - first if end else 0

    def _pool_plan_load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        hit, keys = self._pool_hits.pop(request.request_id)
        if num_external_tokens <= 0:
            return
        if self.hybrid:
            self._pool_plan_groups(request, blocks, hit, num_external_tokens, keys)
            return
        n = num_external_tokens // self.block_size
        first = hit // self.block_size
        local = blocks.get_block_ids()[0][first:first + n]
        self.reading += 1
        if num_external_tokens % self.block_size or len(local) != n or n > len(keys):
            log.error("request %s: cannot plan a pool load of %d tokens into %d blocks", request.request_id,
                      num_external_tokens, len(local))
            self._pool_jobs.append(PoolJob(request.request_id, (), tuple(local), False, error="plan"))
            return
        self._pool_jobs.append(PoolJob(request.request_id, tuple(keys[:n]), tuple(local), False,
                                       traceparent=traceparent_of(request)))

    def _pool_plan_groups(self, request: Request, blocks: KVCacheBlocks, hit: int, num_external_tokens: int,
                          keys: list[int]) -> None:
        """A hybrid cache's pool load: every group's pooled blocks paired with D's allocated ones, all or none."""
        bs = self.groups[0].block_size
        first, end = hit // bs, (hit + num_external_tokens) // bs
        self.reading += 1
        try:
            if (hit + num_external_tokens) % bs or end > len(keys):
                raise ValueError(f"{num_external_tokens} tokens after {hit} are not the {len(keys) - first} "
                                 "pooled blocks looked up")
            plan = pair(self.groups, blocks.blocks, load_groups(self.groups, keys, first, end), end * bs, hit)
        except ValueError as exc:
            log.error("request %s: cannot plan a pool load of %d tokens over KV cache groups %s: %s",
                      request.request_id, num_external_tokens, [g.kind for g in self.groups], exc)
            local = tuple(b.block_id for spec, group in zip(self.groups, blocks.blocks)
                          for b in group[first:] if not getattr(b, "is_null", False) and b.block_id)
            self._pool_jobs.append(PoolJob(request.request_id, (), local, False, error="plan",
                                           tokens=num_external_tokens))
            return
        self._pool_jobs.append(PoolJob(request.request_id, tuple(plan.remote), tuple(plan.local), False,
                                       traceparent=traceparent_of(request), tokens=num_external_tokens))

    def _pool_plan_save(self, request: Request, block_ids: Sequence[Sequence[int]]) -> bool:
        """Queue a save of the request's full computed blocks (every KV cache group's, pdserve.vllm.pool_groups);
        True when its blocks must stay held."""
        if not self.config.pool_save or not self._pool_usable() or not block_ids:
            return False
        if not completed(request):
            return False  # aborted or failed: do not pool what may be partial
        tokens = list(request.all_token_ids[:request.num_computed_tokens])
        bs = self.groups[0].block_size if self.hybrid else self.block_size
        chain = block_hashes(tokens, bs, key_domain(request))
        if self.hybrid:
            keys, ids = save_items(self.groups, block_ids, chain, request.num_computed_tokens)
        else:
            keys, ids = tuple(chain), tuple(block_ids[0][:len(chain)])
        if not keys or len(ids) < len(keys):
            return False
        self._pool_jobs.append(PoolJob(request.request_id, tuple(keys), ids, True,
                                       traceparent=traceparent_of(request)))
        self._pool_saving.add(request.request_id)
        return True

    # ---- D ----
    def _remote(self, request: Request) -> RemoteParams | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return RemoteParams.parse(params, self.block_size)
        except ValueError as exc:
            log.warning("request %s: ignoring kv_transfer_params (%s); it will be computed locally",
                        request.request_id, exc)
            params["do_remote_prefill"] = False
            return None

    def _loadable_tokens(self, request: Request, remote: RemoteParams) -> int:
        """Prompt tokens D may take from P: 0 when the prefix or the layout differs or the lease is
        (nearly) over."""
        m = min(remote.num_tokens, request.num_prompt_tokens)
        # at most all but the last prompt token: vLLM computes at least one token itself (D gets prompt + [t1]
        # from pdserve's router, so this is P's whole prompt; a D given the prompt alone recomputes its last token,
        # unless it continues after P's first token: then t1 is that one, appended once the read ended)
        last = request.num_prompt_tokens - (0 if remote.handoff and asks_to_continue(request.kv_transfer_params)
                                            else 1)
        n = min(m, last)
        if remote.prompt_hash and remote.prompt_hash != prompt_hash(request.prompt_token_ids or [], m):
            log.warning("request %s: prompt differs from the one P prefilled; computing locally",
                        request.request_id)
            return 0
        if not self.prefix_caching and not (n == m == last):
            log.warning("request %s: this engine has prefix caching off, so it computes a prompt in one pass; P's "
                        "KV of %d of its %d prompt tokens would have it compute %d tokens on top of loaded KV: "
                        "computing locally", request.request_id, m, request.num_prompt_tokens,
                        request.num_prompt_tokens - n)
            return 0
        refused = "" if remote.handoff else self._refuse_fingerprint(remote, request)  # (early: the worker checks)
        if refused:
            log.error("request %s: refused P's KV: %s; computing locally", request.request_id, refused)
            self._keep_read(request.request_id, {"ok": False, "bytes": 0, "ms": 0.0, "blocks": 0,
                                                 "refused": refused, "error": refused})
            return 0
        if self.handshake and remote.tp != self.tp:
            refused = self._refuse_sharding(remote)
            if refused:
                log.error("request %s: refused P's KV: %s; computing locally", request.request_id, refused)
                self._keep_read(request.request_id, {"ok": False, "bytes": 0, "ms": 0.0, "blocks": 0,
                                                     "refused": refused, "error": refused})
                return 0
        elif self.handshake and remote.layout and not same_layout(remote.layout, self.handshake.layout):
            log.warning("request %s: P's KV layout %s differs from ours %s (same model, dtype and block "
                        "size on both?); computing locally", request.request_id, remote.layout,
                        self.handshake.layout)
            return 0
        if self.hybrid and n != remote.num_tokens and not self._partial_ok(n, remote.num_tokens):
            log.info("request %s: P handed off the state after %d tokens and D needs it after %d (Mamba state or "
                     "sliding window); computing locally", request.request_id, remote.num_tokens, n)
            return 0
        if remote.lease_deadline and time.time() > remote.lease_deadline - self.config.clock_margin_s:
            log.warning("request %s: P's lease on the blocks has run out; computing locally", request.request_id)
            return 0
        return n

    def _partial_ok(self, n: int, handed: int) -> bool:
        """Whether D may take only the first ``n`` of the ``handed`` tokens: not with a Mamba group (P's state is
        after all of them), and only when every sliding window D needs after ``n`` tokens was handed off."""
        return all(g.kind != MAMBA and (g.kind != SLIDING or g.first_needed(n) >= g.first_needed(handed))
                   for g in self.groups)

    def _refuse_fingerprint(self, remote: RemoteParams, request: Request) -> str:
        """Why P's KV is not this worker's kind of KV, or not this request's key domain ("" when the fingerprints
        agree, or D has none: a fake)."""
        mine = request_fingerprint(self.handshake.fingerprint if self.handshake is not None else None, request)
        if not mine:
            return ""
        if not remote.fingerprint:
            return "fingerprint mismatch: P sent no compatibility fingerprint (an older pdserve?)"
        diff = differences(remote.fingerprint, mine)
        return f"fingerprint mismatch: {'; '.join(diff)}" if diff else ""

    def _refuse_sharding(self, remote: RemoteParams) -> str:
        """Why P's tensor-parallel layout cannot feed ours ("" when every rank can read its head slices)."""
        hs = self.handshake
        assert hs is not None
        mine, theirs = f"D tp={self.tp} x {hs.kv_heads} KV heads, layout {hs.unit or hs.layout}", (
            f"P tp={remote.tp} x {remote.kv_heads} KV heads, layout {remote.unit or remote.layout}")
        if self.hybrid:
            return (f"{theirs} vs {mine}: a hybrid KV cache (KV cache groups {[g.kind for g in self.groups]}) moves "
                    "only between equal tensor-parallel degrees")
        if not remote.unit or not hs.unit or remote.unit != hs.unit:
            return f"{theirs} vs {mine}: KV layouts differ (or a side cannot slice heads)"
        try:
            for r in range(self.tp):
                plan_slices(hs.kv_heads, remote.tp, self.tp, r, remote.kv_heads)
        except ShardError as exc:
            return f"{theirs} vs {mine}: {exc}"
        return ""

    def _keep_read(self, req_id: str, stats: dict[str, Any]) -> None:
        self._reads[req_id] = stats
        while len(self._reads) > MAX_READ_STATS:
            self._reads.popitem(last=False)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._remote(request)
        if remote is None:
            self._refuse_continue(request, "its kv_transfer_params are not a hand-off")
            return self._pool_match(request, num_computed_tokens) if self.pool is not None else (0, False)
        count = self._loadable_tokens(request, remote) - num_computed_tokens
        if count <= 0:
            self._refuse_continue(request, "it reads nothing of P's KV")
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        sync = not remote.handoff and self._sync_load(request, remote, num_computed_tokens, count)
        if sync:
            self._sync.add(request.request_id)
        else:
            self._sync.discard(request.request_id)
        digest = remote.prompt_hash or (prompt_hash(request.prompt_token_ids or [], remote.num_tokens)
                                        if remote.handoff else "")  # (early: P's digest of the same prompt)
        self.stamps.admit(request.request_id, getattr(request, "arrival_time", None), sync, remote.request_id,
                          digest, count)
        return count, not sync

    def _sync_load(self, request: Request, remote: RemoteParams, hit: int, count: int) -> bool:
        """Read inside the next forward (vLLM's synchronous load) when this rank's read is small: at most
        ``sync_load_max_bytes``, this engine's block size in bytes known, the request not forced to ``async``
        and expecting more than one token (vLLM finishes a request before it hears the step's connector output,
        so a one-token decode loaded in its only step could not carry the read's stats in its answer)."""
        hs = self.handshake
        limit = self.config.sync_load_max_bytes
        if limit <= 0 or hs is None or hs.block_bytes <= 0 or remote.load == "async":
            return False
        if any(g.kind == MAMBA for g in self.groups):
            # vLLM copies a Mamba state into the step's new block before the forward (mamba_cache_mode align, a
            # prompt ending on a block boundary), before a synchronous read has landed: load such states a step early
            return False
        params = getattr(request, "sampling_params", None)
        if params is not None and getattr(params, "max_tokens", None) == 1:
            return False
        end = hit + count
        if self.hybrid:  # block positions of every group, each block one page over every region
            blocks = sum(max(0, g.end(end) - max(g.first_needed(end), hit // g.block_size)) for g in self.groups)
        else:
            blocks = -(-end // self.block_size) - hit // self.block_size
        return blocks * hs.block_bytes <= limit

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self.config.kv_checksum and params and params.get("do_remote_decode") and not self.hybrid:
            fault = str(params.get("pdserve_test_fault") or "") if self.config.allow_test_faults else ""
            if self.prefill_seals.watch(request.request_id, request.num_prompt_tokens, fault):
                self._unseal.append(request.request_id)  # sealed before a preemption: the worker forgets it first
        if params and params.get("do_remote_decode") and params.get("pdserve_handoff"):
            self._watch_early(request, params)
        if not params or not params.get("do_remote_prefill"):
            if request.request_id in self._pool_hits:
                self._pool_plan_load(request, blocks, num_external_tokens)
            return
        remote = self._remote(request)
        params["do_remote_prefill"] = False  # one transfer per request, even if rescheduled
        if remote is None:
            return
        hit = self._matched.pop(request.request_id, None)
        sync = request.request_id in self._sync
        self._sync.discard(request.request_id)
        if remote.test_fault and not known_test_fault(remote.test_fault):
            log.warning("unknown pdserve_test_fault %r ignored", remote.test_fault)
        if num_external_tokens <= 0:
            self.stamps.drop(request.request_id)
            self._refuse_continue(request, "it reads nothing of P's KV")
            self._recv.append(RecvJob(request.request_id, remote, BlockPlan((), ()), load=False))
            return
        self.stamps.alloc(request.request_id)
        continues = params.pop(CONTINUE, None) is True
        if continues:  # decided once the read ends (update_connector_output)
            self._continuing[request.request_id] = request
        try:
            if self.hybrid:
                if hit is None:  # (vLLM hashes the blocks of external tokens as it allocates them)
                    raise ValueError("no prefix-cache hit recorded for a hybrid KV cache read")
                if not remote.groups:
                    raise ValueError("P handed off one block list; this model has KV cache groups "
                                     f"{[g.kind for g in self.groups]} (is P's vLLM hybrid KV cache manager off?)")
                plan = pair(self.groups, blocks.blocks, remote.groups, hit + num_external_tokens, hit)
                log.debug("request %s: KV read of %d blocks over %d KV cache groups for %d tokens (%d local)",
                          request.request_id, len(plan), len(self.groups), hit + num_external_tokens, hit)
            else:
                if hit is None:  # count D's prefix-cache hits: leading blocks that already have a hash
                    hit = 0
                    for block in blocks.blocks[0]:
                        if block.block_hash is None:
                            break
                        hit += self.block_size
                if remote.handoff:
                    self._recv.append(self._early_job(request, remote, blocks.get_block_ids()[0], hit,
                                                      num_external_tokens, continues))
                    return
                plan = plan_blocks(blocks.get_block_ids()[0], hit, num_external_tokens, remote.block_ids,
                                   self.block_size)
            self._recv.append(RecvJob(request.request_id, remote, plan, sync=sync, traceparent=traceparent_of(request)))
        except Exception as exc:  # never strand a request in WAITING_FOR_REMOTE_KVS
            log.exception("request %s: cannot plan the KV read", request.request_id)
            if sync:  # scheduled in this step: its blocks are reported invalid, so vLLM recomputes them
                local = tuple(b.block_id for spec, group in zip(self.groups, blocks.blocks)
                              for b in group[(hit or 0) // spec.block_size:]
                              if not getattr(b, "is_null", False)) if self.hybrid else tuple(
                    blocks.get_block_ids()[0][(hit or 0) // self.block_size:])
                self._recv.append(RecvJob(request.request_id, remote, BlockPlan(local, ()), error=repr(exc),
                                          sync=True))
            else:
                self._recv.append(RecvJob(request.request_id, remote, BlockPlan((), ()), error=repr(exc)))

    # ---- P ----
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_groups(request, (block_ids,))

    def request_finished_groups(self, request: Request,
                                block_ids: Sequence[Sequence[int]]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished_all_groups``: the request's blocks per KV cache group (one without HMA)."""
        self._pool_hits.pop(request.request_id, None)
        self._pool_refused.pop(request.request_id, None)
        announced, token = self._settle_early(request)
        delay, out = self._hand_off(request, block_ids, announced)
        if token is not None:  # D continues after P's first token: the second answer, at the next step's start
            self._announce_now[token[0]] = token[1]
        self._settle_seal(request.request_id)
        if self.pool is not None and self._pool_plan_save(request, block_ids):
            delay = True  # the worker reports finished_sending once the save (and any decode read) is done
        return delay, out

    def _hand_off(self, request: Request, groups: Sequence[Sequence[int]],
                  announced: bool = False) -> tuple[bool, dict[str, Any] | None]:
        """P: lease the prompt's blocks to a decode; D: answer the read's stats or release P's blocks.
        ``announced``: an early hand-off's blocks were announced to D, which may be reading them: leased whatever
        way the request ended (D's notification or the lease's end frees them)."""
        params = request.kv_transfer_params
        self._matched.pop(request.request_id, None)
        self._sync.discard(request.request_id)
        self._continuing.pop(request.request_id, None)
        self.stamps.drop(request.request_id)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Never scheduled (e.g. aborted while queued): tell P to free its blocks now.
            remote = self._remote(request)
            params["do_remote_prefill"] = False
            if remote is not None:
                self._recv.append(RecvJob(request.request_id, remote, BlockPlan((), ()), load=False))
            return False, None
        reads = self._reads.pop(request.request_id, None)
        if not params.get("do_remote_decode"):
            return False, ({"pdserve": reads} if reads else None)
        if not completed(request) and not announced:
            return False, None  # aborted or errored prefill: nothing to hand off, free now
        stopped = getattr(request.status, "name", None) == "FINISHED_STOPPED"
        if not announced and params.get(LEASE_ON_STOP) is False and stopped:
            return False, None  # the caller continues only a prompt P ended by length: a stopped one is over
        if self.handshake is None or (self.tp > 1 and len(self.ranks) != self.tp):
            log.error("request %s asked for remote decode but not every worker rank published its transfer "
                      "engine; freeing its blocks", request.request_id)
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        if num_tokens <= 0:
            return False, None
        handed: tuple[tuple[int, tuple[int, ...]], ...] = ()
        if self.hybrid:
            try:
                handed = hand_off(self.groups, groups, num_tokens)
            except ValueError as exc:
                log.error("request %s: cannot hand off its KV (%s); freeing its blocks", request.request_id, exc)
                return False, None
            block_ids = list(flat(handed))
            nblocks = len(block_ids)
        else:
            block_ids = list(groups[0]) if groups else []
            nblocks = -(-num_tokens // self.block_size)
            if len(block_ids) < nblocks:
                return False, None
        deadline = time.time() + self._lease_s(params)
        self._send[request.request_id] = deadline
        if tp := traceparent_of(request):
            self._send_trace[request.request_id] = tp
        self._held.add(request.request_id)
        if self.config.kv_checksum:
            self._seal[request.request_id] = tuple(block_ids[:nblocks])
        fault = params.get("pdserve_test_fault")
        if fault and self.config.allow_test_faults:
            self._faults[request.request_id] = str(fault)
        hs = self.handshake
        ranks = tuple((h.engine_id, h.host, h.port) for h in self.ranks) if self.tp > 1 else ()
        remote = RemoteParams(hs.engine_id, hs.host, hs.port, tuple(block_ids[:nblocks]), num_tokens,
                              request.request_id, hs.layout,
                              prompt_hash(request.prompt_token_ids or [], num_tokens), deadline, "", ranks,
                              hs.kv_heads, hs.unit, fingerprint=request_fingerprint(hs.fingerprint, request),
                              groups=handed)
        out = remote.to_params()
        if not self.prefix_caching:
            # an engine without prefix caching (vLLM's MLA on CPU) computes a prompt in one pass: a D like it can
            # continue only P's whole prompt (its next step is t1), never an early hand-off, where it would compute
            # the last prompt token on top of loaded KV (_loadable_tokens); the router then keeps hand-offs serial
            out[NO_EARLY] = True
        elif hs.layerwise:
            out[LAYERWISE] = True
        return True, out

    def _settle_seal(self, req_id: str) -> None:
        """P: a seal made at the prefill's last forward stands for the lease when it covers the same blocks; else
        the worker forgets it (and seals the leased blocks, if any, as planned in ``_hand_off``)."""
        same, forget = self.prefill_seals.finished(req_id, self._seal.get(req_id))
        if same:
            del self._seal[req_id]
            self._faults.pop(req_id, None)  # applied with that seal
        if forget:
            self._unseal.append(req_id)

    def _lease_s(self, params: dict[str, Any]) -> float:
        """The configured lease, or the request's ``lease_s`` override (router/tests), bounded."""
        if params.get("lease_s") is not None:
            try:
                return min(max(float(params["lease_s"]), 0.1), 3600.0)
            except (TypeError, ValueError):
                pass
        return self.config.lease_s

    # ---- early hand-offs ----
    def _watch_early(self, request: Request, params: dict[str, Any]) -> None:
        """P: follow a request D already has (``pdserve_handoff``) until its prompt is computed."""
        handoff = params.get("pdserve_handoff")
        if not isinstance(handoff, str) or not handoff.startswith(HANDOFF_PREFIX) or self.hybrid:
            return  # (D then waits until P's answer says the hand-off is gone, or its wait ends: it computes)
        self._early[request.request_id] = (handoff, self._lease_s(params), asks_to_continue(params))
        self.prefill_ready.watch(request.request_id, request.num_prompt_tokens)
        self._requests[request.request_id] = request

    def _announce(self, scheduler_output: SchedulerOutput) -> None:
        """P: the early hand-offs whose prompt this step's forward completes, for the worker to announce."""
        for req_id, blocks in self.prefill_ready.step(scheduler_output, {}).items():
            early, request = self._early.get(req_id), self._requests.get(req_id)
            if early is None or request is None:
                continue
            n = request.num_prompt_tokens
            note = ReadyNote(req_id, blocks, n, prompt_hash(request.prompt_token_ids or [], n), time.time() + early[1],
                             request_fingerprint(self.handshake.fingerprint if self.handshake else None, request))
            self._ready[early[0]] = note
            self._announced.add(req_id)
            if early[2]:  # D continues after P's first token: it follows once sampled (_settle_early)
                self._held_notes[req_id] = note

    def _settle_early(self, request: Request) -> tuple[bool, tuple[str, ReadyNote | None] | None]:
        """P's request ended: (whether D was told its blocks, so they must be leased; for a D that continues after
        P's first token, the second answer: the note with that token, or None when there is none to continue after,
        the request not ended by length). If D was never told its blocks, it is told the hand-off is gone."""
        req_id = request.request_id
        early = self._early.pop(req_id, None)
        self._requests.pop(req_id, None)
        held = self._held_notes.pop(req_id, None)
        if early is None:
            return False, None
        self.prefill_ready.finished(req_id, None)
        if req_id not in self._announced:
            self._ready[early[0]] = None
            return False, None
        self._announced.discard(req_id)
        if held is None:
            return True, None
        out = list(getattr(request, "output_token_ids", ()) or ())
        ended = out and getattr(request.status, "name", None) == "FINISHED_LENGTH_CAPPED"
        return True, (early[0], replace(held, first_token=int(out[0])) if ended else None)

    # ---- D: continuing after P's first token ----
    def _refuse_continue(self, request: Request, why: str) -> None:
        """D: a request asked to continue after P's first token that will not read it: one marked token. (P's
        request carries the flag too, with ``do_remote_decode``: P announces its token; it is not D's to mark.)"""
        params = request.kv_transfer_params
        if params and not params.get("do_remote_decode") and params.pop(CONTINUE, None) is True:
            cannot_continue(request, why)

    def _continue(self, req_id: str, stats: dict[str, Any]) -> None:
        """D: the read of a request that continues after P's first token ended: continue, or mark its one token."""
        request = self._continuing.pop(req_id, None)
        if request is None or getattr(request.status, "name", None) != "WAITING_FOR_REMOTE_KVS":
            return
        t1 = stats.get("first_token")
        if isinstance(t1, int) and not isinstance(t1, bool) and continue_after(request, t1):
            self.continued += 1
            self.stamps.continued(req_id, t1)
            return
        cannot_continue(request, "P's answer carried no first token" if t1 is None else
                        f"it cannot continue after {t1!r}")

    def _early_job(self, request: Request, remote: RemoteParams, local_ids: Sequence[int], hit: int,
                   num_external_tokens: int, continues: bool = False) -> RecvJob:
        """D: the read of an early hand-off: D's blocks from ``hit`` on, P's at the same positions once P answers."""
        if hit % self.block_size:
            raise ValueError(f"local hit of {hit} tokens is not a multiple of {self.block_size}")
        first, end = hit // self.block_size, -(-(hit + num_external_tokens) // self.block_size)
        if end > len(local_ids):
            raise ValueError(f"early read needs D's blocks [{first}, {end}) of {len(local_ids)}")
        self._early_reads.add(request.request_id)
        mine = request_fingerprint(self.handshake.fingerprint if self.handshake is not None else None, request)
        return RecvJob(request.request_id, remote, BlockPlan(tuple(local_ids[first:end]), ()), first_block=first,
                       expect_hash=prompt_hash(request.prompt_token_ids or [], remote.num_tokens),
                       expect_fingerprint=mine, continues=continues)

    # ---- per step ----
    def build_connector_meta(self, scheduler_output: SchedulerOutput | None = None) -> PdserveMeta:
        if (scheduler_output is not None and not scheduler_output.total_num_scheduled_tokens
                and not self._recv and not self._send and not self._pool_jobs and not self._seal and not self._unseal
                and not self._announce_now and (self.held > 0 or self._pool_saving) and self.reading == 0
                and self.config.idle_wait_ms > 0):
            # vLLM keeps stepping while P holds blocks for a decode, even with nothing to run: an
            # empty-step loop that busy-spins the engine, worker and API processes (~1.5 cores here)
            # for up to a lease. Pace those steps; a request arriving meanwhile waits at most this.
            time.sleep(self.config.idle_wait_ms / 1e3)
        elif (scheduler_output is not None and not scheduler_output.total_num_scheduled_tokens and not self._recv
              and self._early_reads and self.config.idle_wait_ms > 0):
            # D's early reads wait for P's prefill (seconds, on the cores P computes on). With the worker in this
            # process, sleep until a read ended (pdserve.vllm.read_signal), at most idle_wait_ms (a request that
            # arrives meanwhile waits that long for its admission); else pace the empty steps finely, so that a read
            # that landed is seen within about a millisecond
            if READ_SIGNAL.local:
                READ_SIGNAL.wait(self.config.idle_wait_ms / 1e3)
            else:
                time.sleep(min(self.config.idle_wait_ms, EARLY_PACE_MS) / 1e3)
        if scheduler_output is not None:
            self.stamps.step(getattr(r, "req_id", "") for r in getattr(scheduler_output, "scheduled_new_reqs", ()))
        self.reading += sum(1 for job in self._recv if job.load)
        seal_now = self.prefill_seals.step(scheduler_output, self._faults) if scheduler_output is not None else {}
        if scheduler_output is not None:
            self._announce(scheduler_output)
        meta = PdserveMeta(self._recv, self._send, self._pool_jobs, self._seal, seal_now, self._unseal, self._faults,
                           self._ready, self._announce_now,
                           self._send_trace)
        self._send_trace = {}
        self._recv, self._send, self._pool_jobs, self._seal, self._unseal, self._faults = [], {}, [], {}, [], {}
        self._ready, self._announce_now = {}, {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, PdserveWorkerMeta):
            return
        reads_done = 0
        for req_id, stats in meta.reads.items():  # a read is done once every tensor-parallel rank reported it
            merged = merge_reads(self._partial.pop(req_id, None), stats)
            if merged.get("ranks", 1) < self.tp:
                self._partial[req_id] = merged
                while len(self._partial) > MAX_READ_STATS:
                    self._partial.popitem(last=False)
                continue
            self._keep_read(req_id, merged)
            self._early_reads.discard(req_id)
            self.stamps.read(req_id, merged)
            self._continue(req_id, merged)
            reads_done += 1
        loads_done = sum(1 for v in meta.pool.values() if v.startswith("load"))
        self.reading = max(0, self.reading - reads_done - loads_done)
        for req_id, outcome in meta.pool.items():
            if outcome.startswith("save"):
                self._pool_saving.discard(req_id)
            elif outcome in ("load_partial", "load_failed"):
                self._pool_refused[req_id] = None
                while len(self._pool_refused) > MAX_READ_STATS:
                    self._pool_refused.popitem(last=False)
            self.pool_outcomes[outcome] = self.pool_outcomes.get(outcome, 0) + 1
        self._held.difference_update(meta.released)  # leases that ended (the worker counts them, by reason)
