"""The KV pool for hybrid KV caches (vLLM's hybrid KV cache manager on): which block of which KV cache group is
pooled under which key, and how long a pooled prefix a request may load.

A pool object is one block position of one group (its page over every registered region: block ids are unique
across groups, so a block id names that group's bytes; :mod:`pdserve.vllm.regions`), keyed by the chained block key
of the tokens up to and including that position (:func:`pdserve.hashing.block_hashes`), mixed with the group's
index and kind for every group but the first full-attention one (which keeps the plain key the conductor's index
and a model without groups use). Equal keys still mean equal prefixes, and each key names one group's bytes.

What is saved (:func:`save_items`), from the finished request's block table of each group, positions of full
blocks of its computed tokens only:

* full attention: every position;
* sliding window: the positions the request still holds (not null): a position's KV depends only on the tokens up
  to it, so its key stays valid; positions the window passed are gone and not saved;
* Mamba / linear attention: the state block at the position whose end is exactly the request's computed length
  (``(p + 1) * block_size == num_computed_tokens``): the state after exactly the tokens its key names. vLLM's own
  prefix caching in ``mamba_cache_mode`` align caches a state at a block boundary and hits it only at exactly that
  length (``MambaManager.find_longest_cache_hit``); other state blocks a request still holds at its end (chunk
  boundaries, a prefill checkpoint) are not saved: which tokens such a block's state is after is not in the block
  table (a checkpoint may sit at a hash-block boundary inside the block).

What is loaded (:func:`longest`, :func:`load_groups`): a pooled prefix of ``L`` blocks after D's own hit of
``first`` blocks, ``L * block_size`` at most the prompt less one token (vLLM computes at least one), only when for
every group the positions a request continuing at ``L * block_size`` tokens needs are pooled: full attention
``[first, L)``, a sliding window ``[max(first, first_needed), L)`` (the blocks its next token's window reaches), a
Mamba group the state at ``L - 1`` (the state after exactly ``L`` blocks). Every group's blocks load in one job, all
or nothing (a partial hybrid load is recomputed from D's own hit).

No vLLM import (the scheduler half's unit tests drive it with fakes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from pdserve.hashing import SEED
from pdserve.vllm.groups import FULL, MAMBA, NULL_BLOCK, SLIDING, GroupSpec


def pool_refusal(groups: Sequence[GroupSpec]) -> str:
    """Why pdserve's pool cannot take this hybrid KV cache ("" when it can): its keys need one block size."""
    sizes = sorted({g.block_size for g in groups})
    if len(sizes) > 1:
        return f"its KV cache groups have block sizes {sizes} (tokens) and pool keys name one block size"
    return ""


def _plain(groups: Sequence[GroupSpec]) -> int:
    """The group whose objects keep the plain block key: the first full-attention one (-1: none)."""
    return next((i for i, g in enumerate(groups) if g.kind == FULL), -1)


def group_key(key: int, index: int, spec: GroupSpec) -> int:
    """The key of group ``index``'s object at a position whose plain block key is ``key``."""
    h = hashlib.blake2b(key.to_bytes(8, "little"), digest_size=8, key=SEED)
    h.update(f"group {index} {spec.kind} {spec.block_size} {spec.window}".encode())
    return int.from_bytes(h.digest(), "little")


def keys_of(groups: Sequence[GroupSpec], keys: Sequence[int]) -> list[list[int]]:
    """Per group, the object key of each position of ``keys`` (the prompt's plain block keys)."""
    plain = _plain(groups)
    return [list(keys) if i == plain else [group_key(k, i, g) for k in keys] for i, g in enumerate(groups)]


def save_items(groups: Sequence[GroupSpec], block_ids: Sequence[Sequence[int]], keys: Sequence[int],
               num_computed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(object keys, block ids) a finished request saves: its held blocks at the positions of ``keys`` (the full
    blocks of its ``num_computed`` tokens), per group as the module docstring says."""
    out_keys: list[int] = []
    out_ids: list[int] = []
    for spec, ids, gkeys in zip(groups, block_ids, keys_of(groups, keys)):
        for p, key in enumerate(gkeys):
            if p >= len(ids) or int(ids[p]) == NULL_BLOCK:
                continue
            if spec.kind == MAMBA and (p + 1) * spec.block_size != num_computed:
                continue
            out_keys.append(key)
            out_ids.append(int(ids[p]))
    return tuple(out_keys), tuple(out_ids)


def needed(spec: GroupSpec, first: int, end: int) -> range:
    """The positions of one group a load of blocks ``[first, end)`` must bring (D holds those before ``first``)."""
    if spec.kind == MAMBA:
        return range(end - 1, end) if end > first else range(0)
    if spec.kind == SLIDING:
        return range(max(first, spec.first_needed(end * spec.block_size)), end)
    return range(first, end)


def candidates(groups: Sequence[GroupSpec], keys: Sequence[int], first: int) -> list[int]:
    """Every object key a lookup of a prefix longer than ``first`` blocks may need (asked of the pool at once)."""
    return [k for gkeys in keys_of(groups, keys) for k in gkeys[first:]]


def longest(groups: Sequence[GroupSpec], keys: Sequence[int], first: int, pooled: Iterable[int]) -> int:
    """The longest prefix ``L`` (blocks, ``first < L <= len(keys)``) whose needed objects are all ``pooled``; 0 when
    none. ``keys``: the plain keys of the prompt's loadable blocks (the caller leaves out the last token's)."""
    have = set(pooled)
    gkeys = keys_of(groups, keys)
    for end in range(len(keys), first, -1):
        if all(gk[p] in have for spec, gk in zip(groups, gkeys) for p in needed(spec, first, end)):
            return end
    return 0


def load_groups(groups: Sequence[GroupSpec], keys: Sequence[int], first: int,
                end: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Per group, (first position, object keys from there): what :func:`pdserve.vllm.groups.pair` pairs with D's
    allocated blocks, as it pairs P's hand-off."""
    out = []
    for spec, gk in zip(groups, keys_of(groups, keys[:end])):
        span = needed(spec, first, end)
        out.append((span.start, tuple(gk[p] for p in span)))
    return tuple(out)
