"""KV integrity for reads that reshard heads across tensor-parallel degrees: checksums of one KV head's slice of a
block.

P seals whole blocks of its shard (:class:`~pdserve.vllm.integrity.SealTable`); a D of another TP degree reads only
some heads of each block from each P rank (:func:`pdserve.vllm.shards.slice_entries`), so it cannot compare whole
blocks. Instead D names the P-local heads it read in its notification to each P rank (``#heads=``), and P answers
(:func:`head_reply`):

1. the sums of the blocks D read, recomputed now, must equal P's seal of them (else P's bytes changed after it
   sealed them: a late write; the answer says which blocks, and D fails the read);
2. then, per head D named, the ``xxh3u`` (or ``wsum32``) sum of that head's runs of each block: the units are the
   head's runs (:func:`pdserve.vllm.layout.head_runs`), layer after layer, run after run, which D's run ``i`` of the
   same head pairs with byte for byte (equal unit signatures guarantee equal run lengths).

Since P's bytes equal its sealed bytes when it answers, the head sums are those of the sealed bytes; D computes the
same sums over its own slices (:func:`check_slices`) and a flip in transit, a late write, or a wrong slice shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.transfer import TransferError
from pdserve.vllm.integrity import BlockSums, mismatched
from pdserve.vllm.layout import head_runs
from pdserve.vllm.logs import connector_log
from pdserve.vllm.params import LayerGeometry
from pdserve.vllm.shards import HeadSlice, RankLayer

log = connector_log()


def head_geometry(layers: Sequence[RankLayer], head: int) -> list[LayerGeometry]:
    """The runs of local KV head ``head`` in every layer, as one :class:`LayerGeometry` per layer (the block stride
    of a vLLM block, the head's runs inside it): a :class:`BlockSums` over these hashes that head's slice."""
    out = []
    for layer in layers:
        runs = head_runs(layer.kv, head, layer.ratio)
        out.append(LayerGeometry(layer.name, layer.kv.block_stride * layer.ratio, sum(n for _, n in runs), runs))
    return out


def head_sums(layers: Sequence[RankLayer], memory: Mapping[str, Any], heads: Sequence[int], blocks: Sequence[int],
              alg: str) -> list[list[int]]:
    """Per head of ``heads``, one checksum per block of ``blocks`` over that head's slice, by ``alg``."""
    return [BlockSums(head_geometry(layers, h), dict(memory)).sums(blocks, alg) for h in heads]


def head_reply(reply: dict[str, Any], whole: BlockSums, layers: Sequence[RankLayer], read: Sequence[int],
               heads: Sequence[int]) -> dict[str, Any]:
    """P: its answer to a notification that names ``heads``, from ``reply`` (its whole-block answer,
    :meth:`~pdserve.vllm.integrity.SealTable.reply`): ``{"alg", "fp", "b": read, "h": heads, "c": [[sum per block]
    per head]}``; ``{"fp", "changed": blocks}`` when blocks D read no longer match P's seal; ``reply`` itself when it
    has no sums."""
    if "missing" in reply or not read:
        return reply
    alg = str(reply["alg"])
    sealed = dict(zip(reply.get("b") or [], reply.get("c") or []))
    now = whole.sums(read, alg)
    changed = [b for b, v in zip(read, now) if sealed.get(b) != v]
    if changed:
        return {"fp": reply["fp"], "changed": changed}
    return {"alg": alg, "fp": reply["fp"], "b": list(read), "h": list(heads),
            "c": head_sums(layers, whole.memory, heads, read, alg)}


def _expected(p: int, reply: Any, fingerprint: int) -> tuple[str, dict[int, tuple[str, dict[int, int]]]]:
    """(why P rank ``p``'s ``reply`` cannot vouch for the slices, or ""; P head -> (alg, P block -> sum))."""
    if not isinstance(reply, dict):
        return f"P rank {p} answered no checksums (its kv_checksum is off, or an older pdserve)", {}
    if reply.get("fp") != fingerprint:
        return f"P rank {p}'s fingerprint digest {reply.get('fp')} is not ours ({fingerprint})", {}
    if "missing" in reply:
        return f"P rank {p} has no checksums: {reply['missing']}", {}
    if "changed" in reply:
        return (f"{len(reply['changed'])} blocks differ from P's checksums (P rank {p}'s blocks "
                f"{list(reply['changed'])[:8]} changed after P sealed them)"), {}
    alg = str(reply.get("alg") or "")
    blocks = reply.get("b") or []
    return "", {h: (alg, dict(zip(blocks, sums))) for h, sums in zip(reply.get("h") or [], reply.get("c") or [])}


def check_slices(replies: Mapping[int, Any], fingerprint: int, slices: Sequence[HeadSlice],
                 layers: Sequence[RankLayer], memory: Mapping[str, Any], local: Sequence[int],
                 remote: Sequence[int]) -> tuple[str, int]:
    """D: (why the head slices just read into ``local`` must not be used, "" when they may; how many blocks matched
    in every slice), from each P rank's reply (P rank -> :func:`head_reply`'s answer)."""
    bad: set[int] = set()
    for p in sorted({s.peer_rank for s in slices}):
        problem, expected = _expected(p, replies.get(p), fingerprint)
        if problem:
            return problem, 0
        for s in (s for s in slices if s.peer_rank == p):
            if s.peer_head not in expected:
                return f"P rank {p} answered no checksums for its head {s.peer_head}", 0
            alg, sums = expected[s.peer_head]
            got = head_sums(layers, memory, [s.local], local, alg)[0]
            bad.update(mismatched(sums, local, remote, got))
    if bad:
        return (f"{len(bad)} of {len(local)} blocks differ from P's checksums (head slices; D blocks "
                f"{sorted(bad)[:8]})"), len(local) - len(bad)
    return "", len(local)


def verify_slices(replies: Mapping[int, Any], fingerprint: int, slices: Sequence[HeadSlice],
                  layers: Sequence[RankLayer], memory: Mapping[str, Any], local: Sequence[int],
                  remote: Sequence[int], where: str, stats: dict[str, Any]) -> None:
    """Raise TransferError("checksum") unless every head slice read into ``local`` matches its P rank's answer (so
    vLLM recomputes); counts the matched blocks in ``stats["verified"]``."""
    problem, stats["verified"] = check_slices(replies, fingerprint, slices, layers, memory, local, remote)
    stats["streamed"] = False
    if problem:
        stats["checksum_failed"] = True
        log.error("%s: KV checksum failure: %s; vLLM will recompute", where, problem)
        raise TransferError("checksum", problem)
