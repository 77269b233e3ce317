"""Tensor parallelism: which KV heads each rank holds, which P ranks a D rank reads from, and who notifies whom.

vLLM shards attention by KV head: with ``total`` KV heads and TP degree ``tp``, rank ``r`` holds heads
``[r*total/tp, (r+1)*total/tp)`` when ``tp`` divides ``total``; when ``total`` divides ``tp`` each head is
replicated on ``tp/total`` consecutive ranks and rank ``r`` holds head ``r // (tp/total)``.

* **Same TP on P and D**: D's rank r reads its whole blocks from P's rank r (byte for byte, the layouts are
  equal), and notifies only P's rank r.
* **Different TP**: D's rank reads each of its heads from the P rank that holds it, as head slices of each
  block (:func:`slice_entries`, runs from :func:`pdserve.vllm.layout.head_runs`), one transfer batch per P rank.

P frees a request's blocks on a rank once every D rank that reads from it has notified (:func:`notifiers`:
the count travels in the notification, :func:`notify_message`), so P needs no knowledge of D's TP degree.
Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pdserve.vllm.layout import KVLayout, LayoutError, head_runs, reshard
from pdserve.vllm.params import BlockPlan

NOTE_SEP = "|"  # notification = request id [| sender rank / readers] [#blocks=b1,...] [#heads=h1,...]; a bare id:
BLOCKS_SEP = "#blocks="  # one reader
HEADS_SEP = "#heads="


class ShardError(ValueError):
    """P's and D's tensor-parallel layouts cannot be paired; the message names both."""


def rank_heads(total: int, tp: int, rank: int) -> tuple[int, ...]:
    """Global KV head ids held by ``rank`` of ``tp`` (vLLM's QKV sharding, replicated when tp > total)."""
    if total < 1 or tp < 1 or not 0 <= rank < tp:
        raise ShardError(f"rank {rank} of tp={tp} with {total} KV heads: out of range")
    if total % tp == 0:
        per = total // tp
        return tuple(range(rank * per, (rank + 1) * per))
    if tp % total == 0:
        return (rank // (tp // total),)
    raise ShardError(f"{total} KV heads cannot be split over tp={tp} ranks (neither divides the other)")


def holder(total: int, tp: int, head: int) -> tuple[int, int]:
    """(rank, local head index) of the first rank of ``tp`` holding global ``head``."""
    if total % tp == 0:
        per = total // tp
        return head // per, head % per
    if tp % total == 0:
        return head * (tp // total), 0
    raise ShardError(f"{total} KV heads cannot be split over tp={tp} ranks (neither divides the other)")


@dataclass(frozen=True)
class HeadSlice:
    """D's local head ``local`` comes from P rank ``peer_rank``'s local head ``peer_head``."""

    local: int
    peer_rank: int
    peer_head: int


def describe(tp: int, total: int) -> str:
    return f"tp={tp} x {total} KV heads"


def plan_slices(total: int, p_tp: int, d_tp: int, d_rank: int, p_total: int | None = None) -> tuple[HeadSlice, ...]:
    """The head slices D rank ``d_rank`` reads. Raises :class:`ShardError` naming both layouts when P's and
    D's cannot be paired (different head counts, or a TP degree that does not split the heads)."""
    p_total = total if p_total is None else p_total
    if p_total != total:
        raise ShardError(f"P has {describe(p_tp, p_total)}, D {describe(d_tp, total)}: different models")
    try:
        rank_heads(total, p_tp, 0)
        mine = rank_heads(total, d_tp, d_rank)
    except ShardError as exc:
        raise ShardError(f"P {describe(p_tp, total)} vs D {describe(d_tp, total)}: {exc}") from None
    return tuple(HeadSlice(j, *holder(total, p_tp, g)) for j, g in enumerate(mine))


def peer_ranks(total: int, p_tp: int, d_tp: int, d_rank: int) -> tuple[int, ...]:
    """P ranks D rank ``d_rank`` reads from (same TP: its own rank)."""
    if p_tp == d_tp:
        return (d_rank,)
    return tuple(sorted({s.peer_rank for s in plan_slices(total, p_tp, d_tp, d_rank)}))


def notifiers(total: int, p_tp: int, d_tp: int) -> dict[int, tuple[int, ...]]:
    """P rank -> the D ranks that notify it: those that read from it, or (for a P rank nobody reads, a
    replica) D rank ``p % d_tp`` alone, so every P rank hears and frees its blocks before the lease."""
    readers: dict[int, set[int]] = {p: set() for p in range(p_tp)}
    for d in range(d_tp):
        for p in peer_ranks(total, p_tp, d_tp, d):
            readers[p].add(d)
    return {p: tuple(sorted(ds)) if ds else (p % d_tp,) for p, ds in readers.items()}


def release_notifiers(p_tp: int, d_tp: int) -> dict[int, tuple[int, ...]]:
    """Who notifies whom when D reads nothing (a refused pairing): D rank ``p % d_tp`` tells P rank ``p``."""
    return {p: (p % d_tp,) for p in range(p_tp)}


def to_notify(table: Mapping[int, Sequence[int]], d_rank: int) -> dict[int, int]:
    """P rank -> how many D ranks notify it, for the P ranks that ``d_rank`` notifies."""
    return {p: len(ds) for p, ds in table.items() if d_rank in ds}


def notify_message(req_id: str, sender: int, readers: int, blocks: Sequence[int] = (),
                   heads: Sequence[int] = ()) -> str:
    """The notification one D rank sends with (or instead of) its read of P's request ``req_id``; ``blocks``: P's
    block ids it read, which P checksums itself when its worker has not heard of the lease yet; ``heads``: the P-local
    KV heads it read of them (a read that reshards heads: P answers per-head checksums, pdserve.vllm.head_sums)."""
    head = req_id if readers <= 1 else f"{req_id}{NOTE_SEP}{sender}/{readers}"
    tail = BLOCKS_SEP + ",".join(str(b) for b in blocks) if blocks else ""
    return head + tail + (HEADS_SEP + ",".join(str(h) for h in heads) if heads else "")


def split_heads(msg: str) -> tuple[str, tuple[int, ...]]:
    """(the notification without its ``#heads=`` part, the heads it names: none for a whole-block read)."""
    head, sep, tail = msg.rpartition(HEADS_SEP)
    if sep and tail and all(x.isdigit() for x in tail.split(",")):
        return head, tuple(int(x) for x in tail.split(","))
    return msg, ()


def parse_notify(msg: str) -> tuple[str, int, int, tuple[int, ...]]:
    """(P request id, sender D rank, readers expected, P's blocks read): a bare id is one reader (TP=1 D, or an
    old D), and names no blocks."""
    blocks: tuple[int, ...] = ()
    head, sep, tail = msg.rpartition(BLOCKS_SEP)
    if sep and tail and all(x.isdigit() for x in tail.split(",")):
        msg, blocks = head, tuple(int(x) for x in tail.split(","))
    head, sep, tail = msg.rpartition(NOTE_SEP)
    sender, slash, readers = tail.partition("/")
    if sep and slash and sender.isdigit() and readers.isdigit() and int(readers) >= 1:
        return head, int(sender), int(readers), blocks
    return msg, 0, 1, blocks


@dataclass(frozen=True)
class RankLayer:
    """One layer of a rank: its region name, KV layout and kernel blocks per vLLM block."""

    name: str
    kv: KVLayout
    ratio: int = 1


def slice_entries(layers: Iterable[RankLayer], plan: BlockPlan, slices: Sequence[HeadSlice], peer_heads: int,
                  peer_blocks: int) -> dict[int, list[tuple[str, int, str, int, int]]]:
    """P rank -> transfer entries (local_region, local_off, peer_region, peer_off, length) that copy D's head
    slices of ``plan``'s blocks from the P ranks holding them. P's layout is D's with ``peer_heads`` heads per
    rank and ``peer_blocks`` kernel blocks (:func:`reshard`); run i of a head on D pairs with run i on P."""
    out: dict[int, list[tuple[str, int, str, int, int]]] = {}
    for layer in layers:
        mine = layer.kv
        peer = reshard(mine, peer_heads, peer_blocks or mine.num_blocks)
        stride_l, stride_p = mine.block_stride * layer.ratio, peer.block_stride * layer.ratio
        for s in slices:
            local_runs, peer_runs = head_runs(mine, s.local, layer.ratio), head_runs(peer, s.peer_head, layer.ratio)
            if [n for _, n in local_runs] != [n for _, n in peer_runs]:
                raise ShardError(f"layer {layer.name}: head runs differ between D ({mine.describe()}) and P "
                                 f"({peer.describe()})")
            dst = out.setdefault(s.peer_rank, [])
            for lb, rb in zip(plan.local, plan.remote):
                for (lo, n), (po, _) in zip(local_runs, peer_runs):
                    dst.append((layer.name, lb * stride_l + lo, layer.name, rb * stride_p + po, n))
    for entries in out.values():
        entries.sort(key=lambda e: (e[0], e[1]))  # memory order on D: the engine merges adjacent runs
    return out


def unit_signature(dtype: str, block_size: int, layers: Sequence[RankLayer]) -> str:
    """Equal on P and D iff their caches are arranged alike whatever their TP degree and block count: each
    layer's layout reduced to one head and one block (dtype, block size, order, interior, a head's runs).
    "" when a layer's heads cannot be sliced (then only the same TP degree on both sides can hand off)."""
    try:
        geo = []
        for layer in sorted(layers, key=lambda x: x.name):
            u = reshard(layer.kv, 1, 1)
            geo.append((layer.name, layer.ratio, u.order, u.interior, u.block_tokens, u.elem,
                        tuple(n for _, n in head_runs(u, 0, layer.ratio))))
    except (LayoutError, ValueError):
        return ""
    h = hashlib.blake2b(repr((dtype, block_size, geo)).encode(), digest_size=8).hexdigest()
    return f"{dtype}/bs{block_size}/L{len(geo)}/unit/{h}"
