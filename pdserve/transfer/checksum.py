"""Checksums of byte spans, for verifying what a transfer delivered.

Two algorithms, named on the wire so the verifier computes what the producer computed:

* ``xxh3`` (:func:`xxh3_spans`): xxHash's XXH3-64 streamed over a sequence of byte spans of host memory. Each span
  is passed to the hasher as a buffer (memoryview or numpy view): no copy of the bytes is made.
* ``wsum32`` (:func:`wsum_rows`): a position-weighted sum for device memory, computed in one batched torch op per
  (layer, run) over every block at once: the bytes of each row viewed as little-endian int32 words ``w_j``,
  ``sum_j w_j * (2 * (first_word + j) + 1)`` in int64 (wrapping). Every weight is odd, so any change to a
  single word changes the sum (``d * odd != 0 mod 2**64`` for ``0 < |d| < 2**32``), and words that swap places
  change it unless they are equal. Integer addition is associative, so the result does not depend on the
  reduction order: a CUDA sum equals the CPU sum of the same bytes. Tested on CPU tensors only; it has not run on
  a GPU.

Nothing here knows what the bytes mean; callers group spans into blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import xxhash

XXH3 = "xxh3"
WSUM = "wsum32"
ALGORITHMS = (XXH3, WSUM)
MASK64 = (1 << 64) - 1


def xxh3_spans(spans: Iterable[Any]) -> int:
    """XXH3-64 of the concatenation of ``spans`` (buffers: memoryview, numpy array, bytes), as an unsigned int.
    Zero-copy: each span is hashed in place."""
    h = xxhash.xxh3_64()
    for span in spans:
        h.update(span)
    return h.intdigest()


def wsum_rows(rows: Any, first_word: int = 0) -> Any:
    """Position-weighted int64 sums of the rows of ``rows`` (a ``[n, nbytes]`` uint8 torch tensor on any device,
    ``nbytes`` a multiple of 4): one value per row, word ``j`` of each row weighted ``2 * (first_word + j) + 1``.
    Sums of consecutive pieces of one block add up to the block's sum when ``first_word`` counts the words before
    each piece."""
    import torch

    n, nbytes = rows.shape
    if nbytes % 4:
        raise ValueError(f"wsum32 needs whole 32-bit words; a row of {nbytes} bytes is not")
    words = rows.contiguous().view(torch.int32).to(torch.int64)
    weights = torch.arange(first_word, first_word + nbytes // 4, dtype=torch.int64, device=rows.device) * 2 + 1
    return (words * weights).sum(dim=1)


def to_u64(value: int) -> int:
    """An int64 sum as the unsigned 64-bit value that travels in msgpack."""
    return int(value) & MASK64
