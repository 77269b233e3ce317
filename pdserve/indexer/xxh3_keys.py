"""Mooncake's XXH3 rolling sequence hashes (its KV indexer API's hashing standard), mapped to pdserve's block keys.

Mooncake's standard (docs/source/design/conductor/indexer-api-design.md, "Hashing standard"): a block's local hash
is XXH3-64 with seed S of its tokens as little-endian u32; the first block's sequence hash is its local hash, and
block i's is XXH3-64 with seed S of (sequence hash i-1 as little-endian u64, local hash i as little-endian u64).

The indexer keys every block by pdserve's chained key (:mod:`pdserve.hashing`), which the router, the conductor and
the pool share. :class:`Xxh3Keys` learns, from the token ids vLLM's ``BlockStored`` events carry, each stored
block's sequence hash beside its key, so ``/query_by_hash`` with ``"hash": "xxh3"`` answers a client that computed
Mooncake's hashes. Mooncake's hash has no salt: a request's key domain (cache salt, LoRA adapter) scopes the map
instead, as the query's ``cache_salt`` / ``lora_name`` scope a ``/query``. The map is bounded (``max_blocks``, the
oldest learned go first): a block it forgot is not found by its XXH3 hash (an under-estimate, as a missed event).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from ..conductor.events import StoredRun

MASK64 = (1 << 64) - 1


def local_hash(tokens: Sequence[int], seed: int = 0) -> int:
    """One block's local hash: XXH3-64 of its tokens as little-endian u32."""
    a = array("I", tokens)
    if sys.byteorder != "little":
        a.byteswap()
    return xxhash.xxh3_64_intdigest(a.tobytes(), seed)


def chain(prev: int, local: int, seed: int = 0) -> int:
    """The sequence hash of a block after one whose sequence hash is ``prev``."""
    return xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + local.to_bytes(8, "little"), seed)


def seq_hashes(tokens: Sequence[int], block_size: int, seed: int = 0, prev: int | None = None) -> list[int]:
    """The sequence hashes of every full block of ``tokens`` (after a block whose sequence hash is ``prev``; None:
    from the first block)."""
    if block_size <= 0:
        raise ValueError(f"block_size={block_size}: must be a positive number of tokens")
    out: list[int] = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        local = local_hash(tokens[start:start + block_size], seed)
        prev = local if prev is None else chain(prev, local, seed)
        out.append(prev)
    return out


class Xxh3Keys:
    """(key domain root, XXH3 sequence hash) -> pdserve key, learned from stored runs (see the module docstring)."""

    def __init__(self, block_size: int, seed: int = 0, max_blocks: int = 2_000_000) -> None:
        if not 0 <= seed <= MASK64:
            raise ValueError(f"xxh3 seed {seed}: use an integer in [0, 2**64)")
        self.block_size, self.seed, self.max_blocks = block_size, seed, max_blocks
        self.by_hash: dict[tuple[int, int], int] = {}
        self.of_key: dict[int, tuple[int, int]] = {}  # pdserve key -> (its domain root, its sequence hash)
        self.unchained = 0  # runs whose parent block was never learned (or forgotten): not mapped

    def learn(self, runs: Iterable[StoredRun]) -> None:
        for run in runs:
            if run.first:
                domain, prev = run.parent, None
            else:
                known = self.of_key.get(run.parent)
                if known is None:
                    self.unchained += 1
                    continue
                domain, prev = known
            for key, h in zip(run.keys, seq_hashes(run.tokens, self.block_size, self.seed, prev)):
                self._put(domain, h, key)

    def _put(self, domain: int, h: int, key: int) -> None:
        if key in self.of_key:
            return
        self.by_hash[(domain, h)] = key
        self.of_key[key] = (domain, h)
        while len(self.of_key) > self.max_blocks:
            old = next(iter(self.of_key))
            self.by_hash.pop(self.of_key.pop(old), None)

    def keys(self, hashes: Sequence[int], domain: int) -> list[int]:
        """pdserve's keys of the leading ``hashes`` the map knows in ``domain`` (a prefix: it stops at the first
        unknown one)."""
        out: list[int] = []
        for h in hashes:
            key = self.by_hash.get((domain, h))
            if key is None:
                break
            out.append(key)
        return out

    def __len__(self) -> int:
        return len(self.of_key)

    # ---- snapshots (pdserve.indexer.snapshot) ----
    def capture(self) -> dict[str, Any]:
        n = len(self.of_key)
        keys = np.fromiter(self.of_key, dtype="<u8", count=n)
        domains = np.fromiter((d for d, _ in self.of_key.values()), dtype="<u8", count=n)
        hashes = np.fromiter((h for _, h in self.of_key.values()), dtype="<u8", count=n)
        return {"seed": self.seed, "keys": keys.tobytes(), "domains": domains.tobytes(), "hashes": hashes.tobytes()}

    def restore(self, doc: dict[str, Any]) -> bool:
        """Take a captured map; False (nothing taken) when it was made with another seed."""
        if int(doc.get("seed", -1)) != self.seed:
            return False
        cols = [np.frombuffer(doc[name], dtype="<u8").tolist() for name in ("keys", "domains", "hashes")]
        for key, domain, h in zip(*cols):
            self._put(domain, h, key)
        return True
