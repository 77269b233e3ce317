"""Where test faults ``flip`` (D: corruption in transit) and ``late`` (P: a write after its seal) change bytes:
plain, the first byte of the first unit of the first block; ``flip~SEED`` / ``late~SEED``, bytes at random offsets
of several units (one to four, anywhere in the blocks: any block, any layer, any run), each XORed with a random
non-zero mask, drawn from ``SEED`` (the corruption tally's random placements, benchmarks/corruption_tally.py). D
applies a flip before it hashes the unit (as it lands, or after the read), so a checksum that misses one shows as
an undetected corruption. Honoured only with ``allow_test_faults``."""

from __future__ import annotations

import random
from collections.abc import Sequence

Flip = tuple[int, int, int, int]  # (block's place in the read, unit index in the block, byte in the unit, XOR mask)
MAX_UNITS = 4


SEEDED = ("flip", "late")  # the faults that take ``~SEED``


def fault_seed(fault: str) -> int | None:
    """``SEED`` of ``flip~SEED`` / ``late~SEED`` (either ``@R``); None for any other fault."""
    kind = fault.partition("@")[0]
    base, tilde, seed = kind.partition("~")
    return int(seed) if base in SEEDED and tilde and seed.isdigit() else None


def placements(fault: str, unit_sizes: Sequence[int], blocks: int) -> list[Flip]:
    """The flips of ``fault`` in a read of ``blocks`` blocks whose units have ``unit_sizes`` bytes each."""
    if not blocks or not unit_sizes:
        return []
    seed = fault_seed(fault)
    if seed is None:
        return [(0, 0, 0, 0xFF)]
    rng = random.Random(seed)
    units = [(slot, k) for slot in range(blocks) for k in range(len(unit_sizes))]
    picked = rng.sample(units, min(len(units), rng.randint(1, MAX_UNITS)))
    return [(slot, k, rng.randrange(unit_sizes[k]), rng.randrange(1, 256)) for slot, k in picked]
