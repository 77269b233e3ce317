"""The connector's KV pool (pdserve.store) object layout, without vLLM imports. The jobs themselves are
:class:`pdserve.vllm.messages.PoolJob`; when a saved request's blocks are freed is
:class:`pdserve.vllm.release.ReleaseLedger`'s decision.

A pool object is one KV block of one request position: the block's bytes of every layer, layer after
layer, run after run (one run per layer when a block's interior is contiguous, as in vLLM's CPU
cache), keyed by :func:`pdserve.hashing.block_hashes` of the tokens up to and including that block,
so equal keys mean equal prefixes on every worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.vllm.messages import PoolJob
from pdserve.vllm.params import LayerGeometry

__all__ = ["PoolJob", "loaded_prefix", "pool_items"]


def pool_items(layers: Sequence[LayerGeometry], keys: Sequence[int],
               block_ids: Sequence[int]) -> list[tuple[int, list[tuple[str, int, int]]]]:
    """(key, [(layer region, offset, length), ...]) for StoreClient.put / get_into."""
    return [(key, [(g.name, bid * g.block_stride + off, n) for g in layers for off, n in g.block_runs])
            for key, bid in zip(keys, block_ids)]


def loaded_prefix(got: Sequence[bool]) -> int:
    """Blocks usable from a partial load: the ones before the first that did not arrive."""
    for i, ok in enumerate(got):
        if not ok:
            return i
    return len(got)
