"""The connector's use of the KV pool (pdserve.store), without vLLM imports: jobs, object layout, and the
gate that frees a finished request's blocks only when every reader of them is done.

A pool object is one KV block of one request position: the block's bytes of every layer, layer after
layer (each layer's block is contiguous in vLLM's CPU cache), keyed by :func:`pdserve.hashing.block_hashes`
of the tokens up to and including that block, so equal keys mean equal prefixes on every worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from pdserve.vllm.params import LayerGeometry


@dataclass(frozen=True)
class PoolJob:
    """Scheduler -> worker: save ``block_ids`` to the pool under ``keys`` (save=True) or load them."""

    req_id: str
    keys: tuple[int, ...]
    block_ids: tuple[int, ...]
    save: bool
    error: str = ""  # the scheduler could not plan it: the worker reports the load failed


def pool_items(layers: Sequence[LayerGeometry], keys: Sequence[int],
               block_ids: Sequence[int]) -> list[tuple[int, list[tuple[str, int, int]]]]:
    """(key, [(layer region, offset, length), ...]) for StoreClient.put / get_into."""
    return [(key, [(g.name, bid * g.block_stride, g.block_bytes) for g in layers])
            for key, bid in zip(keys, block_ids)]


def loaded_prefix(got: Sequence[bool]) -> int:
    """Blocks usable from a partial load: the ones before the first that did not arrive."""
    for i, ok in enumerate(got):
        if not ok:
            return i
    return len(got)


@dataclass
class SendGate:
    """When may a finished request's held blocks be freed (reported ``finished_sending``)?

    A request is held for a decode's read (a P lease) and/or for a pool save. It is released once every
    hold it has is over: a lease released while the save still runs waits for the save, and a save that
    ends while a lease is still held leaves the release to the lease.
    """

    saving: set[str] = field(default_factory=set)
    waiting_for_save: set[str] = field(default_factory=set)

    def start_save(self, req_id: str) -> None:
        self.saving.add(req_id)

    def release(self, leases_over: Iterable[str], saves_done: Iterable[str],
                still_leased: Callable[[str], bool]) -> set[str]:
        out: set[str] = set()
        for req_id in leases_over:
            if req_id in self.saving:
                self.waiting_for_save.add(req_id)
            else:
                out.add(req_id)
        for req_id in saves_done:
            self.saving.discard(req_id)
            if req_id in self.waiting_for_save:
                self.waiting_for_save.discard(req_id)
                out.add(req_id)
            elif not still_leased(req_id):
                out.add(req_id)
        return out
