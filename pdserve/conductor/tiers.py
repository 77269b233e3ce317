"""Where a cached KV block lives: its tier, and the index holder name of (owner, tier).

The prefix index (:mod:`.index`) keys holders by name. A worker's own device blocks keep the worker's name as
their holder (what placement has always read); every other tier of the same owner is ``"<owner>#<tier>"``, so
one index answers "which worker holds this prefix, and where". The KV pool's memory tier keeps the holder name
``pool`` (the conductor's ``fetchable`` holder).

vLLM publishes a block's medium in its ``BlockStored`` / ``BlockRemoved`` events: ``GPU`` for the engine's own KV
cache (on the CPU build too: it is the cache vLLM computes into), ``CPU`` for its host offload, ``STORAGE`` for
its disk offload; vLLM's MooncakeStoreConnector publishes ``cpu`` (lower case) for blocks it put into the
Mooncake Store. None (older publishers) is the device.
"""

from __future__ import annotations

DEVICE = "device"
HOST = "host"
DISK = "disk"  # a worker's own disk offload (vLLM's STORAGE medium)
POOL_MEMORY = "pool_memory"
POOL_DISK = "pool_disk"
STORE = "store"  # a remote store (Mooncake Store)
TIERS = (DEVICE, HOST, DISK, POOL_MEMORY, POOL_DISK, STORE)

SEP = "#"
POOL = "pool"  # the KV pool's owner name (its memory tier's holder is plain "pool")

# vLLM's medium strings, exactly as published (MooncakeStoreConnector's "cpu" is its store put)
_MEDIA = {None: DEVICE, "GPU": DEVICE, "CPU": HOST, "STORAGE": DISK, "cpu": STORE}


def tier_of_medium(medium: object) -> str | None:
    """The tier of a vLLM event's ``medium``; None for a medium pdserve does not know (its blocks are skipped)."""
    return _MEDIA.get(medium) if medium is None or isinstance(medium, str) else None


def holder_of(owner: str, tier: str) -> str:
    """The index holder of ``owner``'s blocks in ``tier``: the owner itself for a worker's device and the pool's
    memory, else ``owner#tier``."""
    if tier == DEVICE or (owner == POOL and tier == POOL_MEMORY):
        return owner
    return f"{owner}{SEP}{tier}"


def split_holder(holder: str) -> tuple[str, str]:
    """(owner, tier) of an index holder name (the inverse of :func:`holder_of`)."""
    owner, sep, tier = holder.partition(SEP)
    if sep:
        return owner, tier
    return owner, POOL_MEMORY if owner == POOL else DEVICE
