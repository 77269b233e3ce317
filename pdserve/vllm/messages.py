"""What crosses between the connector's two halves (scheduler process <-> worker process).

vLLM carries these objects; pdserve never puts them on its own wire. Nothing here imports vLLM: the facade
(:mod:`pdserve.vllm.connector`) registers :class:`PdserveMeta`, :class:`PdserveWorkerMeta` and
:class:`PdserveHandshake` as virtual subclasses of vLLM's ``KVConnectorMetadata``,
``KVConnectorWorkerMetadata`` and ``KVConnectorHandshakeMetadata`` (those are empty marker ABCs), so the
scheduler half builds and reads them without importing vLLM.

* scheduler -> worker, every step (``build_connector_meta`` -> ``start_load_kv``): :class:`PdserveMeta`;
* worker -> scheduler, every step (``build_connector_worker_meta`` -> ``update_connector_output``):
  :class:`PdserveWorkerMeta`, beside vLLM's own finished_sending / finished_recving / failed_recving sets;
* worker -> scheduler, once at start-up (``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``):
  :class:`PdserveHandshake`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.vllm.params import BlockPlan, RemoteParams

# PdserveWorkerMeta.released values: why a P lease ended.
NOTIFIED = "notified"  # D's READ batch notification (or D's release-without-read) arrived
LEASE = "lease"  # the lease deadline passed first


@dataclass
class RecvJob:
    """D-side: read ``plan`` from P and report the request finished/failed receiving.

    ``load`` False: vLLM expects nothing (local prefix hit covers the prompt, or the request ended
    before it was scheduled); only notify P so it frees its blocks now. ``error``: the scheduler
    could not plan the read; the worker reports the load failed so vLLM recomputes.

    ``sync`` True: vLLM scheduled the request in this very step (a synchronous load): the worker reads
    before the step's forward returns from ``start_load_kv``, reports nothing in finished_recving, and
    on failure only the blocks as invalid (vLLM then recomputes from the first bad block).
    """

    req_id: str
    remote: RemoteParams
    plan: BlockPlan
    load: bool = True
    error: str = ""
    sync: bool = False
    traceparent: str = ""  # the request's trace (spans.py: the read's span joins it)
    # an early hand-off (``remote.handoff``): P's block ids are not known yet; ``plan.remote`` is empty and D's
    # ``plan.local`` takes P's blocks from position ``first_block`` on, once P answers the rendezvous
    # (pdserve.vllm.handoff_board); D checks P's answer against its own prompt digest and fingerprint
    first_block: int = 0
    expect_hash: str = ""
    expect_fingerprint: dict[str, str] | None = None
    first_token: int | None = None  # P's first token, from P's answer to the rendezvous (the read's stats carry it)
    continues: bool = False  # D continues after P's first token: after the read it asks P for it (TOKEN_PREFIX)


@dataclass(frozen=True)
class ReadyNote:
    """P, scheduler -> worker: the prompt of an early hand-off is computed in ``blocks`` (by this step's forward);
    what D needs to read it, answered to D's rendezvous (pdserve.vllm.handoff_board)."""

    req_id: str  # P's request id: D's READ notification names it, which ends the lease
    blocks: tuple[int, ...]
    num_tokens: int
    prompt_hash: str
    lease_deadline: float  # wall clock; the lease itself starts when P's request finishes, a little later
    fingerprint: dict[str, str] | None = None
    # P's first token (sampled in the step that completed the prompt), for a D that continues after it
    # (pdserve.vllm.continuation); None: the note went out before P sampled it (D regenerates it)
    first_token: int | None = None

    def to_wire(self) -> dict[str, Any]:
        out = {"req": self.req_id, "blocks": list(self.blocks), "n": self.num_tokens, "ph": self.prompt_hash,
               "dl": self.lease_deadline, "fp": dict(self.fingerprint) if self.fingerprint else None}
        if self.first_token is not None:
            out["t1"] = self.first_token
        return out

    @classmethod
    def from_wire(cls, raw: Any) -> ReadyNote:
        """Raises ValueError on anything but :meth:`to_wire`'s shape."""
        try:
            blocks = tuple(int(b) for b in raw["blocks"])
            fp = raw.get("fp")
            if fp is not None and not (isinstance(fp, dict) and all(isinstance(v, str) for v in fp.values())):
                raise ValueError("fingerprint")
            t1 = raw.get("t1")
            if t1 is not None and (not isinstance(t1, int) or isinstance(t1, bool)):
                raise ValueError("first token")
            return cls(str(raw["req"]), blocks, int(raw["n"]), str(raw["ph"]), float(raw["dl"]), fp, t1)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed hand-off answer: {exc!r}") from None


@dataclass(frozen=True)
class PoolJob:
    """Scheduler -> worker: save ``block_ids`` to the pool under ``keys`` (save=True) or load them."""

    req_id: str
    keys: tuple[int, ...]
    block_ids: tuple[int, ...]
    save: bool
    error: str = ""  # the scheduler could not plan it: the worker reports the load failed
    traceparent: str = ""  # the request's trace (spans.py)
    # a hybrid KV cache's load (every KV cache group's blocks, pdserve.vllm.pool_groups): the tokens it brings,
    # all or none (0: one group, the tokens of the blocks before the first that did not arrive)
    tokens: int = 0


@dataclass
class PdserveMeta:
    """Scheduler -> worker, once per step."""

    recv: list[RecvJob] = field(default_factory=list)
    send: dict[str, float] = field(default_factory=dict)  # P request id -> lease deadline (time.time())
    pool: list[PoolJob] = field(default_factory=list)  # KV pool saves and loads
    # P request id -> its leased block ids, to checksum now (kv_checksum on; pdserve.vllm.integrity.SealTable)
    seal: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # P request id -> its prompt's blocks, to checksum right after this step's forward, which completes the
    # prompt (pdserve.vllm.prefill_seals); unseal: such checksums to forget (not leased, or other blocks)
    seal_now: dict[str, tuple[int, ...]] = field(default_factory=dict)
    unseal: list[str] = field(default_factory=list)
    faults: dict[str, str] = field(default_factory=dict)  # P request id -> its test fault (allow_test_faults)
    # P, early hand-offs: hand-off id -> its prompt's blocks, announced after this step's forward (and seal); None:
    # P's request ended before its prompt was computed, so D stops waiting (pdserve.vllm.handoff_board)
    ready: dict[str, ReadyNote | None] = field(default_factory=dict)
    # P, early hand-offs whose D continues after P's first token: the note again with that token once P sampled it
    # (None: there is none to continue after), announced as soon as the worker has this metadata, before the forward
    announce: dict[str, ReadyNote | None] = field(default_factory=dict)
    # P request id -> its traceparent (the router's prefill attempt), for the lease's span; only traced requests
    send_trace: dict[str, str] = field(default_factory=dict)


@dataclass
class PdserveWorkerMeta:
    """Worker -> scheduler: per-request READ results (for D's kv_transfer_params) and outcomes."""

    reads: dict[str, dict[str, Any]] = field(default_factory=dict)
    released: dict[str, str] = field(default_factory=dict)  # P request id -> NOTIFIED | LEASE (lease ended)
    pool: dict[str, str] = field(default_factory=dict)  # request id -> "saved" | "loaded" | "load_failed" ...

    def is_empty(self) -> bool:
        return not self.reads and not self.released and not self.pool

    def aggregate(self, other: PdserveWorkerMeta) -> PdserveWorkerMeta:
        """vLLM merges the metas of every rank of one step with this."""
        assert isinstance(other, PdserveWorkerMeta)
        merged = PdserveWorkerMeta(dict(self.reads), dict(self.released), {**self.pool, **other.pool})
        for req_id, stats in other.reads.items():  # tensor parallel: every rank reads its shard
            merged.reads[req_id] = merge_reads(merged.reads.get(req_id), stats)
        merged.released.update(other.released)
        return merged


def merge_reads(mine: dict[str, Any] | None, other: dict[str, Any]) -> dict[str, Any]:
    """One request's read stats over tensor-parallel ranks: bytes add up, the slowest rank's time counts
    (``t0``/``t1``: the earliest start, the latest end), ok only if every rank's read was; ``ranks`` counts the
    ranks merged, ``per_rank`` keeps each one's [bytes, ms]; the first error is kept."""
    if mine is None:
        return dict(other)
    out = {**mine, "bytes": mine["bytes"] + other["bytes"], "ms": max(mine["ms"], other["ms"]),
           "ok": mine["ok"] and other["ok"]}
    if "ranks" in mine or "ranks" in other:
        out["ranks"] = mine.get("ranks", 1) + other.get("ranks", 1)
        out["per_rank"] = {**mine.get("per_rank", {}), **other.get("per_rank", {})}
    if "error" in other and "error" not in mine:
        out["error"] = other["error"]
    if "first_token" in other and "first_token" not in mine:
        out["first_token"] = other["first_token"]
    if "t0" in mine and "t0" in other:  # wall clock: the first rank's start, the slowest rank's end
        out["t0"], out["t1"] = min(mine["t0"], other["t0"]), max(mine.get("t1", 0.0), other.get("t1", 0.0))
    return out


@dataclass
class PdserveHandshake:
    """Worker -> scheduler at start-up: the worker's transfer engine and KV layout."""

    engine_id: str
    host: str
    port: int
    layout: str
    rank: int = 0  # tensor-parallel rank of this worker
    kv_heads: int = 0  # the model's total KV heads (each rank holds its share)
    unit: str = ""  # TP-independent layout signature (pdserve.vllm.shards.unit_signature)
    block_bytes: int = 0  # bytes of one block over every layer of this rank's shard (0: unknown, never sync)
    fingerprint: dict[str, str] = field(default_factory=dict)  # compatibility fingerprint (pdserve.vllm.fingerprint)
    layerwise: bool = False  # an early hand-off's layers are announced as the forward writes them (host memory)
