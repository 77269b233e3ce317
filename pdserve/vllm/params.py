"""Configuration, ``kv_transfer_params`` schema and block planning of the pdserve KV connector.

Nothing here imports vLLM or torch: the connector (``pdserve.vllm.connector``) wires these pieces
into vLLM's scheduler and worker hooks, and unit tests drive them directly.

Request path (docs/architecture.md, section 3):

* prefill worker P gets ``{"do_remote_decode": true}``; when the request ends, P keeps the prompt's
  KV blocks and answers :class:`RemoteParams` (``do_remote_prefill`` + where the blocks are);
* decode worker D gets those params back unchanged, READs the blocks it lacks from P's registered
  KV cache with one transfer batch whose notification (``remote_request_id``) tells P to free them;
  P frees them anyway when the lease runs out (``pdserve.vllm.release``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.settings.connector import (  # noqa: F401  (re-exported: the connector's settings live in the config layer)
    BACKENDS,
    LEASE_MAX_S,
    LEASE_MIN_S,
    MIN_SECRET_LEN,
    SECRET_ENV,
    ConfigError,
    ConnectorConfig,
)
from pdserve.vllm.fingerprint import parse as parse_fingerprint

HANDOFF_PREFIX = "hoff-"  # an early hand-off's id (pdserve.vllm.handoff_board imports it from here)
NO_EARLY = "pdserve_no_early"  # in P's answer: this fleet's engines cannot continue an early hand-off exactly
# in P's answer: P announces an early hand-off's layers as its forward writes them (layerwise_kv on host memory), so a
# D of the same TP and layout has P's whole KV when P's forward ends (the router's --early-continue auto reads it)
LAYERWISE = "pdserve_layerwise"

# Test-only faults (honoured only with allow_test_faults): "zero" zeroes the received blocks after
# the read and its checksum check (real corruption of the KV D uses: the negative control); "fail" fails the read
# (D must recompute); "flip" flips a byte of the first received block before the check (corruption in transit);
# "late" (given to P) flips a byte of P's first leased block after P sealed it, before D reads (a late write).
LOAD_MODES = ("", "auto", "async")  # kv_transfer_params.pdserve_load: auto = by sync_load_max_bytes
# "zero@R" / "fail@R": only the shard read from P's tensor-parallel rank R ("flip@R": D rank R); "flip~SEED" /
# "late~SEED": bytes changed at random places of several units (pdserve.vllm.flips)
TEST_FAULTS = ("zero", "fail", "flip", "late")


def fault_hits(fault: str, kind: str, peer_rank: int) -> bool:
    """Whether test fault ``fault`` (``kind``, ``kind~SEED`` or either ``@R``) applies to the read from P's rank
    ``peer_rank``."""
    name, at, rank = fault.partition("@")
    return name.partition("~")[0] == kind and (not at or rank == str(peer_rank))


def known_test_fault(fault: str) -> bool:
    name, at, rank = fault.partition("@")
    kind, tilde, seed = name.partition("~")
    return (kind in TEST_FAULTS and (not tilde or (kind in ("flip", "late") and seed.isdigit()))
            and (not at or rank.isdigit()))




def prompt_hash(token_ids: Sequence[int], n: int) -> str:
    """A short digest of the first ``n`` prompt tokens: D loads P's KV only for the same prefix."""
    h = hashlib.blake2b(digest_size=12)
    h.update(n.to_bytes(4, "little"))
    # int32 little-endian packing without numpy: fast enough for a few thousand tokens.
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids[:n]))
    return h.hexdigest()


@dataclass(frozen=True)
class RemoteParams:
    """P's answer (``kv_transfer_params``) naming the blocks D should read."""

    engine_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    num_tokens: int
    request_id: str
    layout: str = ""  # KV layout signature; D refuses a layout unlike its own
    prompt_hash: str = ""  # digest of the first num_tokens prompt tokens
    lease_deadline: float = 0.0  # P's wall clock (time.time()) after which the blocks may be gone
    test_fault: str = ""
    # tensor parallelism (pdserve.vllm.shards): P's ranks' transfer engines (rank 0 = engine_id/host/port),
    # its model's total KV heads and its TP-independent layout signature (both: a D with another TP slices heads)
    ranks: tuple[tuple[str, str, int], ...] = ()
    kv_heads: int = 0
    unit: str = ""
    load: str = ""  # "async": D loads asynchronously whatever the size (pdserve_load, tests and A/B runs)
    fingerprint: Mapping[str, str] | None = None  # P's compatibility fingerprint (pdserve.vllm.fingerprint)
    # hybrid KV cache (vLLM's HMA, several KV cache groups): per group, (first block position, block ids from
    # there) as pdserve.vllm.groups.hand_off names them; block_ids is then every group's ids, flat
    groups: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # an early hand-off (the router sent D while P prefills): its id; P's block ids, request id, prompt digest,
    # lease and fingerprint then come from P's answer to D's rendezvous (pdserve.vllm.handoff_board), not from here
    handoff: str = ""

    @property
    def tp(self) -> int:
        return max(1, len(self.ranks))

    def rank(self, r: int) -> tuple[str, str, int]:
        """(engine id, host, port) of P's rank ``r``."""
        return self.ranks[r] if self.ranks else (self.engine_id, self.host, self.port)

    def to_params(self) -> dict[str, Any]:
        out = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_host": self.host, "remote_port": self.port,
            "remote_block_ids": list(self.block_ids), "remote_num_tokens": self.num_tokens,
            "remote_request_id": self.request_id, "remote_kv_layout": self.layout,
            "remote_prompt_hash": self.prompt_hash, "remote_lease_deadline": self.lease_deadline,
        }
        if self.ranks:
            out["remote_ranks"] = [list(r) for r in self.ranks]
        if self.kv_heads:
            out["remote_kv_heads"], out["remote_kv_unit"] = self.kv_heads, self.unit
        if self.fingerprint:
            out["remote_fingerprint"] = dict(self.fingerprint)
        if self.groups:
            out["remote_group_blocks"] = [[first, list(ids)] for first, ids in self.groups]
        return out

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None, block_size: int) -> RemoteParams:
        """Validate D's kv_transfer_params; raise ValueError saying what is wrong."""
        if not params or not params.get("do_remote_prefill"):
            raise ValueError("not a remote-prefill request (do_remote_prefill is not true)")
        missing = [k for k in ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids",
                               "remote_num_tokens", "remote_request_id") if params.get(k) is None]
        if missing:
            raise ValueError(f"kv_transfer_params lacks {missing}: pass P's kv_transfer_params unchanged")
        try:
            blocks = tuple(int(b) for b in params["remote_block_ids"])
            num_tokens = int(params["remote_num_tokens"])
            port = int(params["remote_port"])
            deadline = float(params.get("remote_lease_deadline") or 0.0)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed kv_transfer_params: {exc}") from None
        if num_tokens < 0 or any(b < 0 for b in blocks) or not 0 < port < 65536:
            raise ValueError("kv_transfer_params: negative block id/token count or bad port")
        groups = parse_groups(params["remote_group_blocks"]) if params.get("remote_group_blocks") else ()
        handoff = params.get("pdserve_handoff") or ""
        if handoff and (not isinstance(handoff, str) or not handoff.startswith(HANDOFF_PREFIX) or groups):
            raise ValueError(f"kv_transfer_params.pdserve_handoff={handoff!r}: a router's hand-off id "
                             f"({HANDOFF_PREFIX}...), for a model without KV cache groups")
        if not groups and not handoff and len(blocks) < -(-num_tokens // block_size):
            raise ValueError(f"kv_transfer_params: {len(blocks)} remote blocks cannot hold {num_tokens} "
                             f"tokens of {block_size} per block (P and D must use the same block size)")
        fault = params.get("pdserve_test_fault") or ""
        load = params.get("pdserve_load") or ""
        if load not in LOAD_MODES:
            raise ValueError(f"kv_transfer_params.pdserve_load={load!r}: use one of {LOAD_MODES} (or leave it out)")
        ranks, heads = _parse_ranks(params.get("remote_ranks")), params.get("remote_kv_heads") or 0
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 0:
            raise ValueError(f"kv_transfer_params.remote_kv_heads={heads!r}: pass P's kv_transfer_params unchanged")
        fingerprint = parse_fingerprint(params.get("remote_fingerprint"))
        return cls(str(params["remote_engine_id"]), str(params["remote_host"]), port, blocks, num_tokens,
                   str(params["remote_request_id"]), str(params.get("remote_kv_layout") or ""),
                   str(params.get("remote_prompt_hash") or ""), deadline, str(fault), ranks, heads,
                   str(params.get("remote_kv_unit") or ""), load, fingerprint or None, groups, handoff)


def parse_groups(raw: Any, count: int = 0) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``remote_group_blocks`` of P's kv_transfer_params: [[first position, [block ids]], ...] per group."""
    bad = ValueError("kv_transfer_params.remote_group_blocks must be [[first position, [block ids]], ...] per KV "
                     "cache group: pass P's kv_transfer_params unchanged")
    if not isinstance(raw, list) or (count and len(raw) != count):
        raise bad
    out = []
    for item in raw:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[1], (list, tuple)):
            raise bad
        first, ids = item
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise bad
        if any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in ids):
            raise bad
        out.append((first, tuple(ids)))
    return tuple(out)


MAX_TP = 1024


def _parse_ranks(raw: Any) -> tuple[tuple[str, str, int], ...]:
    """``remote_ranks``: [[engine id, host, port], ...] per P tensor-parallel rank (absent: P has one rank)."""
    if raw is None:
        return ()
    bad = ValueError("kv_transfer_params.remote_ranks must be a list of [engine_id, host, port] per P rank: "
                     "pass P's kv_transfer_params unchanged")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_TP:
        raise bad
    out = []
    for item in raw:
        if (not isinstance(item, (list, tuple)) or len(item) != 3 or not isinstance(item[0], str)
                or not isinstance(item[1], str) or isinstance(item[2], bool) or not isinstance(item[2], int)
                or not 0 < item[2] < 65536):
            raise bad
        out.append((item[0], item[1], item[2]))
    return tuple(out)


@dataclass(frozen=True)
class BlockPlan:
    """Which local blocks receive which remote blocks (same positions in the two block tables)."""

    local: tuple[int, ...]
    remote: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.local)


def plan_blocks(local_block_ids: Sequence[int], num_local_hit_tokens: int, num_external_tokens: int,
                remote_block_ids: Sequence[int], block_size: int) -> BlockPlan:
    """Pair the blocks D lacks with P's: D holds the first ``num_local_hit_tokens`` (block-aligned,
    from its own prefix cache); the next ``num_external_tokens`` come from P, block position for
    block position."""
    if num_local_hit_tokens % block_size:
        raise ValueError(f"local hit of {num_local_hit_tokens} tokens is not a multiple of {block_size}")
    first = num_local_hit_tokens // block_size
    end = -(-(num_local_hit_tokens + num_external_tokens) // block_size)
    if end > len(local_block_ids) or end > len(remote_block_ids):
        raise ValueError(f"plan needs blocks [{first}, {end}) but D has {len(local_block_ids)} and P "
                         f"{len(remote_block_ids)}")
    return BlockPlan(tuple(local_block_ids[first:end]), tuple(remote_block_ids[first:end]))


@dataclass(frozen=True)
class LayerGeometry:
    """Where one layer's KV blocks live inside its registered region: block ``b`` is the byte ranges
    ``[b*block_stride + off, +length)`` for each ``(off, length)`` of ``runs`` (derived from the layer's
    :class:`~pdserve.vllm.layout.KVLayout`); no runs = one run ``(0, block_bytes)``."""

    name: str  # region name (the vLLM layer name)
    block_stride: int  # bytes between consecutive (manager) blocks
    block_bytes: int  # bytes of one (manager) block: K and V of every head, over all its runs
    runs: tuple[tuple[int, int], ...] = ()
    interior: str = ""  # KVLayout.interior: how a block's bytes are arranged (part of the signature)
    scales: tuple[int, ...] = ()  # per run: offset bytes per kernel block of the cache (KVLayout.scales)
    num_blocks: int = 0  # kernel blocks of this side's cache (with scales: the peer's offsets differ)

    @property
    def block_runs(self) -> tuple[tuple[int, int], ...]:
        return self.runs or ((0, self.block_bytes),)

    @property
    def run_scales(self) -> tuple[int, ...]:
        return self.scales or (0,) * len(self.block_runs)

    def peer_shift(self, peer_blocks: int) -> tuple[int, ...]:
        """Per run: add to our offset to get the peer's, when the peer's cache has ``peer_blocks``."""
        if not peer_blocks or not any(self.run_scales):
            return (0,) * len(self.block_runs)
        return tuple(sc * (peer_blocks - self.num_blocks) for sc in self.run_scales)


def build_entries(layers: Iterable[LayerGeometry], plan: BlockPlan,
                  peer_blocks: int = 0) -> list[tuple[str, int, str, int, int]]:
    """Transfer entries (local_region, local_off, peer_region, peer_off, length): one per layer per
    block per contiguous run (K and V planes apart: two), in memory order so the engine merges
    adjacent runs. Both sides share the geometry (the layout signature says so) except where a run
    sits past all blocks of another plane: there the peer's offset follows its ``peer_blocks``."""
    entries = []
    for layer in layers:
        runs, shift = layer.block_runs, layer.peer_shift(peer_blocks)
        for lb, rb in zip(plan.local, plan.remote):
            for (off, n), d in zip(runs, shift):
                entries.append((layer.name, lb * layer.block_stride + off, layer.name,
                                rb * layer.block_stride + off + d, n))
    return entries


def layout_signature(dtype: str, layers: Sequence[LayerGeometry], block_size: int) -> str:
    """Equal on P and D iff a block copied byte for byte means the same KV on both: dtype, block size,
    each layer's block stride, run structure and interior arrangement. Readable head (runs per block x
    run bytes), hashed tail."""
    geo = sorted((g.name, g.block_stride, g.block_bytes, g.interior,
                  tuple((off - sc * g.num_blocks, n, sc) for (off, n), sc in zip(g.block_runs, g.run_scales)))
                 for g in layers)
    shapes = sorted({(len(g.block_runs), g.block_runs[0][1]) for g in layers})
    runs = ",".join(f"{k}x{n}" for k, n in shapes)
    h = hashlib.blake2b(repr((dtype, block_size, geo)).encode(), digest_size=8).hexdigest()
    return f"{dtype}/bs{block_size}/L{len(geo)}/runs{runs}/{h}"


PEER_BLOCKS_SEP = "+nb"  # worker layout = signature [+nb<kernel blocks>] when runs depend on the block count


def with_blocks(signature: str, layers: Sequence[LayerGeometry]) -> str:
    """The layout string a worker publishes: the signature, plus its kernel block count when some run's
    offset depends on it (so a peer can address those runs). Refuses layers that disagree on it."""
    counts = {g.num_blocks for g in layers if any(g.run_scales)}
    if len(counts) > 1:
        raise ValueError(f"KV layers with block-count-dependent runs have different block counts {sorted(counts)}")
    return f"{signature}{PEER_BLOCKS_SEP}{counts.pop()}" if counts else signature


def same_layout(a: str, b: str) -> bool:
    """Equal signatures (block counts may differ: entries follow the peer's)."""
    return a.split(PEER_BLOCKS_SEP)[0] == b.split(PEER_BLOCKS_SEP)[0]


def layout_blocks(layout: str) -> int:
    """The kernel block count a layout string carries (0: none needed)."""
    _, sep, tail = layout.partition(PEER_BLOCKS_SEP)
    return int(tail) if sep and tail.isdigit() else 0
