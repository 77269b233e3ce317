"""The connector's KV pool (pdserve.store) object layout, without vLLM imports. The jobs themselves are
:class:`pdserve.vllm.messages.PoolJob`; when a saved request's blocks are freed is
:class:`pdserve.vllm.release.ReleaseLedger`'s decision.

A pool object is one KV block of one request position: the block's bytes of every layer, layer after
layer, run after run (one run per layer when a block's interior is contiguous, as in vLLM's CPU
cache), then a 24-byte **seal**: three little-endian uint64s, ``MAGIC | algorithm``, the writer's compatibility
fingerprint digest (:func:`pdserve.vllm.fingerprint.digest`) and the block's checksum (0 with ``kv_checksum``
off). Keyed by :func:`pdserve.hashing.block_hashes` of the tokens up to and including that block, so equal keys
mean equal prefixes; the seal says whose KV it is. The seal travels with the bytes (arena, SSD file, replicas,
master restarts): the pool's metadata is unchanged. A reader loads the seal into a slot of its own registered
:class:`SealSlots` region next to the block, and uses the block only when the fingerprint is its own and the
checksum matches the bytes that arrived; otherwise the block is a miss (recomputed) and the failure is counted.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from pdserve.transfer.checksum import ALGORITHMS
from pdserve.vllm.messages import PoolJob
from pdserve.vllm.params import LayerGeometry

__all__ = ["SEAL_BYTES", "SEAL_REGION", "PoolJob", "SealSlots", "loaded_prefix", "loaded_tokens", "pool_items",
           "seal_problem"]

SEAL_REGION = "pdserve.seal"
SEAL_BYTES = 24
MAGIC = 0x7064_6B76_0001_0000  # "pdkv", seal version 1; the low byte names the algorithm (0: no checksum)


class SealSlots:
    """A registered array of seal slots (24 bytes each), handed out per pool job. Thread-safe."""

    def __init__(self, slots: int = 1 << 15) -> None:
        self.words = np.zeros((slots, 3), dtype=np.uint64)
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def buffer(self) -> np.ndarray:
        """What to register with the transfer engine as :data:`SEAL_REGION`."""
        return self.words.view(np.uint8).reshape(-1)

    def take(self, n: int) -> list[int]:
        """``n`` free slots, or [] when there are not that many (the job then goes without the pool)."""
        with self._lock:
            if n > len(self._free):
                return []
            out = [self._free.pop() for _ in range(n)]
        self.words[out] = 0
        return out

    def give(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def write(self, slot: int, alg: str, fingerprint: int, checksum: int) -> None:
        code = ALGORITHMS.index(alg) + 1 if alg else 0
        self.words[slot] = (MAGIC | code, fingerprint, checksum)

    def read(self, slot: int) -> tuple[str, int, int] | None:
        """(algorithm, fingerprint, checksum) of a loaded seal; None when the slot holds no seal."""
        tag, fingerprint, checksum = (int(w) for w in self.words[slot])
        code = tag & 0xFF
        if tag & ~0xFF != MAGIC or code > len(ALGORITHMS):
            return None
        return (ALGORITHMS[code - 1] if code else "", fingerprint, checksum)


def seal_problem(seal: tuple[str, int, int] | None, fingerprint: int, checksum: int | None) -> str:
    """Why a loaded block must not be used ("" when it may): no seal, another fingerprint, or (``checksum`` given:
    the sum of the bytes that arrived) a checksum mismatch or a seal without a checksum."""
    if seal is None:
        return "no seal (not written by this connector version)"
    alg, fp, want = seal
    if fp != fingerprint:
        return f"fingerprint {fp:016x} is not ours ({fingerprint:016x}): another model, dtype or layout"
    if checksum is None:
        return ""
    if not alg:
        return "the writer stored no checksum (kv_checksum off there)"
    return "" if want == checksum else f"checksum {checksum:016x} != sealed {want:016x}"


def pool_items(layers: Sequence[LayerGeometry], keys: Sequence[int], block_ids: Sequence[int],
               slots: Sequence[int] = ()) -> list[tuple[int, list[tuple[str, int, int]]]]:
    """(key, [(layer region, offset, length), ..., (SEAL_REGION, slot offset, 24)]) for StoreClient.put /
    get_into; no seal piece when ``slots`` is empty."""
    out = []
    for i, (key, bid) in enumerate(zip(keys, block_ids)):
        pieces = [(g.name, bid * g.block_stride + off, n) for g in layers for off, n in g.block_runs]
        if slots:
            pieces.append((SEAL_REGION, slots[i] * SEAL_BYTES, SEAL_BYTES))
        out.append((key, pieces))
    return out


def loaded_prefix(got: Sequence[bool]) -> int:
    """Blocks usable from a partial load: the ones before the first that did not arrive."""
    for i, ok in enumerate(got):
        if not ok:
            return i
    return len(got)


def loaded_tokens(job: PoolJob, good: int, block_size: int) -> tuple[int, int]:
    """(blocks vLLM may keep, tokens they hold) of a load whose first ``good`` blocks arrived verified. A hybrid
    cache's load (``job.tokens``: every KV cache group's blocks, pdserve.vllm.pool_groups) is all or none: a
    window or a state without the rest of its prefix is no prefix, so anything short of all is recomputed."""
    if job.tokens:
        return (len(job.block_ids), job.tokens) if good >= len(job.block_ids) else (0, 0)
    return good, good * block_size
