"""Checksums of byte spans, for verifying what a transfer delivered.

Three algorithms, named on the wire so the verifier computes what the producer computed:

* ``xxh3u`` (:func:`xxh3_unit`, the default for host memory): the sum mod 2**64 of XXH3-64 of each *unit* of a
  block (one contiguous run of one layer), seeded with the unit's index in the block. Each unit is hashed on its
  own, in any order, so a reader can hash the units that have arrived while the rest of a transfer is still moving
  and add them up; a change inside any unit changes its hash (and so the sum) but for a 2**-64 chance, and the
  seed ties each hash to its place. python-xxhash releases the GIL while it hashes a large buffer, so a hashing
  thread runs beside the transfer's threads.
* ``xxh3`` (:func:`xxh3_spans`): xxHash's XXH3-64 streamed over a sequence of byte spans of host memory. Each span
  is passed to the hasher as a buffer (memoryview or numpy view): no copy of the bytes is made. Kept so that pool
  objects sealed with it still verify.
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
XXH3U = "xxh3u"
ALGORITHMS = (XXH3, WSUM, XXH3U)  # append only: a pool seal stores the index
MASK64 = (1 << 64) - 1


def xxh3_spans(spans: Iterable[Any]) -> int:
    """XXH3-64 of the concatenation of ``spans`` (buffers: memoryview, numpy array, bytes), as an unsigned int.
    Zero-copy: each span is hashed in place."""
    h = xxhash.xxh3_64()
    for span in spans:
        h.update(span)
    return h.intdigest()


def xxh3_unit(span: Any, index: int) -> int:
    """XXH3-64 of one unit of a block (a buffer), seeded with its index ``index`` in the block; an ``xxh3u`` block
    checksum is the sum of its units' values mod 2**64 (:func:`sum_u64`)."""
    return xxhash.xxh3_64_intdigest(span, seed=index)


def sum_u64(values: Iterable[int]) -> int:
    """``values`` summed mod 2**64: an ``xxh3u`` block checksum from its units' values."""
    return sum(values) & MASK64


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
