"""Chained block keys: one function shared by the router, the conductor, the connector and the KV pool.

A prompt is cut into full blocks of ``block_size`` tokens (a trailing partial block has no key). The key of
block i is a 64-bit BLAKE2b of (key of block i-1, the block's token ids as little-endian int64), keyed with a
fixed seed, so equal keys mean equal prefixes, and the keys never depend on vLLM's internal (per-process
seeded) block hashes. Keys are plain Python ints in [0, 2**64): msgpack carries them as uint64.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

SEED = b"pdserve-kv-block-v1"
ROOT_KEY = 0  # the "previous key" of the first block


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """Key of one full block whose predecessor's key is ``parent`` (ROOT_KEY for the first block)."""
    h = hashlib.blake2b(digest_size=8, key=SEED)
    h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """Keys of every full block of ``token_ids``, chained from ``parent``."""
    if block_size <= 0:
        raise ValueError(f"block_size={block_size}: must be a positive number of tokens")
    arr = np.asarray(token_ids, dtype="<i8")
    keys: list[int] = []
    for start in range(0, len(arr) - block_size + 1, block_size):
        h = hashlib.blake2b(digest_size=8, key=SEED)
        h.update(parent.to_bytes(8, "little"))
        h.update(arr[start:start + block_size].tobytes())
        parent = int.from_bytes(h.digest(), "little")
        keys.append(parent)
    return keys
