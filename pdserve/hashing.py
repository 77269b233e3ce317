"""Chained block keys: one function shared by the router, the conductor, the connector and the KV pool.

A prompt is cut into full blocks of ``block_size`` tokens (a trailing partial block has no key). The key of
block i is a 64-bit BLAKE2b of (key of block i-1, the block's token ids as little-endian int64), keyed with a
fixed seed, so equal keys mean equal prefixes, and the keys never depend on vLLM's internal (per-process
seeded) block hashes. Keys are plain Python ints in [0, 2**64): msgpack carries them as uint64.

Everything besides the tokens that changes a block's KV (the request's ``cache_salt``, its LoRA adapter) is the
*key domain*: the chain of such a request starts from :func:`domain_root` instead of ``ROOT_KEY``, so two requests
with equal tokens and different domains share no key, in the conductor's index, the KV pool or anywhere else.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

SEED = b"pdserve-kv-block-v1"
ROOT_KEY = 0  # the "previous key" of the first block


def _le_int64(tokens: Sequence[int]) -> bytes:
    a = array("q", tokens)  # array() from a list is ~2x faster than numpy here (router hot path)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def domain_root(cache_salt: str | None = None, lora: str | None = None) -> int:
    """The parent of a request's first block: ``ROOT_KEY`` with neither a salt nor an adapter, else a 64-bit key of
    both (length-prefixed, so no two domains share the bytes)."""
    if not cache_salt and not lora:
        return ROOT_KEY
    h = hashlib.blake2b(b"domain", digest_size=8, key=SEED)
    for part in (cache_salt or "", lora or ""):
        raw = part.encode()
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return int.from_bytes(h.digest(), "little")


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """Key of one full block whose predecessor's key is ``parent`` (ROOT_KEY for the first block)."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8, key=SEED)
    h.update(_le_int64(tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """Keys of every full block of ``token_ids``, chained from ``parent``."""
    if block_size <= 0:
        raise ValueError(f"block_size={block_size}: must be a positive number of tokens")
    n = len(token_ids) // block_size
    buf = _le_int64(token_ids[:n * block_size])
    step = block_size * 8
    keys: list[int] = []
    for start in range(0, n * step, step):
        h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8, key=SEED)
        h.update(buf[start:start + step])
        parent = int.from_bytes(h.digest(), "little")
        keys.append(parent)
    return keys
