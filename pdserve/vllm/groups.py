"""KV cache groups under vLLM's hybrid KV cache manager (HMA): which of a request's blocks a hand-off moves.

With HMA on, vLLM gives each request one block table per KV cache group, position-indexed (block ``p`` of a
group holds tokens ``[p*bs, (p+1)*bs)`` of that group's block size ``bs``), with vLLM's null block (id 0) where the
group keeps nothing:

* full attention: every block of the prompt;
* sliding window of ``W`` tokens: only the blocks the next token's window reaches (``get_num_skipped_tokens``:
  the first ``N - W + 1`` tokens are skipped, their blocks are null);
* Mamba / linear attention (gated delta-net): one state block, at the position of the last computed token (the
  state at the end of the prompt); earlier positions are null or prefix-cache checkpoints.

P names, per group, the first position it hands off and the block ids from there (:func:`hand_off`); D pairs them
position for position with the blocks it allocated and has not got from its own prefix cache (:func:`pair`).
Every group's blocks live in the same registered regions (vLLM's HMA lets one layer of each group share a
tensor, block ids being unique across groups), so the pairs of all groups form one :class:`BlockPlan`.

No vLLM import: kv cache specs and blocks are duck-typed (``block_size``, ``sliding_window``; ``block_id``,
``block_hash``, ``is_null``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.vllm.params import BlockPlan

NULL_BLOCK = 0  # vLLM's null block id (BlockPool.null_block)
FULL, SLIDING, MAMBA = "full", "sliding", "mamba"


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: its kind, block size (tokens) and sliding window (tokens, 0 without)."""

    kind: str
    block_size: int
    window: int = 0

    def first_needed(self, num_tokens: int) -> int:
        """The first block position the next token (at position ``num_tokens``) needs."""
        if self.kind == SLIDING and self.window:
            return max(0, num_tokens - self.window + 1) // self.block_size
        if self.kind == MAMBA:
            return max(0, -(-num_tokens // self.block_size) - 1)
        return 0

    def end(self, num_tokens: int) -> int:
        """One past the last block position holding the first ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)


def spec_of(kv_cache_spec: Any, default_block_size: int) -> GroupSpec:
    """A vLLM ``KVCacheSpec`` as a :class:`GroupSpec` (by class name: no vLLM import)."""
    name = type(kv_cache_spec).__name__
    block_size = int(getattr(kv_cache_spec, "block_size", 0) or default_block_size)
    if "Mamba" in name:
        return GroupSpec(MAMBA, block_size)
    window = getattr(kv_cache_spec, "sliding_window", None)
    if "SlidingWindow" in name and window:
        return GroupSpec(SLIDING, block_size, int(window))
    if "Attention" in name or "Sink" in name:  # with the manager off a window layer is a FullAttentionSpec that
        return GroupSpec(FULL, block_size)  # names its window (for the kernel) and keeps every block
    raise ValueError(f"KV cache group of {name}: pdserve's connector moves full attention, sliding-window and "
                     "Mamba / linear-attention groups only")


def groups_of(kv_cache_config: Any, default_block_size: int) -> tuple[GroupSpec, ...]:
    """The transfer groups of vLLM's ``KVCacheConfig`` (every group when it names none)."""
    groups = getattr(kv_cache_config, "transfer_groups", None)
    if groups is None:
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return tuple(spec_of(g.kv_cache_spec, default_block_size) for g in groups)


def is_hybrid(groups: Sequence[GroupSpec]) -> bool:
    """More than one group, or a group that is not full attention: the hand-off names blocks per group."""
    return len(groups) > 1 or any(g.kind != FULL for g in groups)


def hybrid_tag(groups: Sequence[GroupSpec]) -> str:
    """The groups as part of a KV layout signature ("" for one full-attention group), so P and D agree on them."""
    if not is_hybrid(groups):
        return ""
    return "+hma:" + ".".join(f"{g.kind[0]}{g.block_size}" + (f"w{g.window}" if g.window else "") for g in groups)


def hand_off(groups: Sequence[GroupSpec], block_ids: Sequence[Sequence[int]],
             num_tokens: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """P: per group, (first position, block ids from there to the end of the prompt's ``num_tokens``) that a decode
    needs to continue the prompt. Raises ValueError when a needed block is gone (null)."""
    if len(block_ids) != len(groups):
        raise ValueError(f"{len(block_ids)} block lists for {len(groups)} KV cache groups")
    out = []
    for spec, ids in zip(groups, block_ids):
        first, end = spec.first_needed(num_tokens), spec.end(num_tokens)
        part = tuple(int(b) for b in ids[first:end])
        if len(part) != end - first or NULL_BLOCK in part:
            raise ValueError(f"{spec.kind} group (block size {spec.block_size}): blocks [{first}, {end}) of "
                             f"{num_tokens} tokens are not all held ({list(ids[first:end])})")
        out.append((first, part))
    return tuple(out)


def flat(remote_groups: Sequence[tuple[int, Sequence[int]]]) -> tuple[int, ...]:
    """Every block id of a hand-off, group after group."""
    return tuple(b for _, ids in remote_groups for b in ids)


def pair(groups: Sequence[GroupSpec], local_blocks: Sequence[Sequence[Any]],
         remote_groups: Sequence[tuple[int, Sequence[int]]], num_tokens: int, hit: int = 0) -> BlockPlan:
    """D: P's blocks for the first ``num_tokens`` tokens paired with the blocks D allocated for them, position for
    position, group after group: D's blocks that are not null, past its own prefix-cache hit of ``hit`` tokens
    (vLLM hashes the blocks of external tokens as it allocates them, so a hash does not tell a hit). Raises
    ValueError when D needs a position P did not hand off."""
    if len(local_blocks) != len(groups) or len(remote_groups) != len(groups):
        raise ValueError(f"D has {len(local_blocks)} block lists and P {len(remote_groups)} for "
                         f"{len(groups)} KV cache groups")
    local: list[int] = []
    remote: list[int] = []
    for spec, blocks, (first, ids) in zip(groups, local_blocks, remote_groups):
        for p in range(hit // spec.block_size, min(spec.end(num_tokens), len(blocks))):
            block = blocks[p]
            if getattr(block, "is_null", False) or block.block_id == NULL_BLOCK:
                continue
            if not first <= p < first + len(ids):
                raise ValueError(f"{spec.kind} group: D needs block position {p} of {num_tokens} tokens, P handed "
                                 f"off positions [{first}, {first + len(ids)})")
            local.append(block.block_id)
            remote.append(int(ids[p - first]))
    return BlockPlan(tuple(local), tuple(remote))

