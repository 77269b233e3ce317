"""vLLM KV cache events -> prefix-index updates keyed by :mod:`pdserve.hashing` keys.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``) publishes, per
scheduler step, a msgpack ``[ts, [event, ...], dp_rank]`` where each event is a map with ``type``:
``BlockStored`` (vLLM block hashes, parent hash, the blocks' token ids, block size), ``BlockRemoved`` (vLLM
hashes) or ``AllBlocksCleared``. vLLM's hashes are seeded per process, so the translator re-keys every stored
block with our chained hash of its token ids, remembering vLLM hash -> our key per worker so removals and
children resolve. A stored block whose parent was never seen (events lost) cannot be keyed and is skipped.
The key domain (:func:`pdserve.hashing.domain_root`) comes from the event's ``lora_name`` and the first block's
``extra_keys`` (vLLM publishes the cache salt there, untagged, after the LoRA name): a salted or adapter block is
keyed in its own domain, exactly as the router keys that request's prompt. Blocks with other extra keys
(multimodal inputs, prompt embeddings) are skipped.
A gap or restart in the publisher's sequence numbers makes the translator report a clear: the worker's index
entries are dropped and rebuilt from later events (an under-estimate of its cache, never an over-estimate).

Each event's ``medium`` names its tier (:mod:`.tiers`: the device, vLLM's host or disk offload, the Mooncake
Store); the translator keeps one vLLM hash -> key map per tier, so a block dropped from the host offload stays
on the device, and every op carries its tier. :meth:`IndexUpdate.apply_to` gives a tier's blocks to the holder
:func:`~pdserve.conductor.tiers.holder_of` names (the worker itself for the device).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from ..hashing import block_key, domain_root
from .tiers import DEVICE, holder_of, tier_of_medium


@dataclass(frozen=True)
class StoredRun:
    """A run of consecutive blocks one ``BlockStored`` event stored: their ``keys`` and ``tokens``, after the block
    whose key is ``parent``, or, ``first``, from the prompt's start in the key domain whose root is ``parent`` (what
    the indexer needs to hash them another way: pdserve.indexer.xxh3_keys)."""

    parent: int
    first: bool
    keys: Sequence[int]
    tokens: Sequence[int]


@dataclass
class IndexUpdate:
    """``ops``: ("stored" | "removed" | "cleared", keys, tier) in event order (apply them in this order; a clear's
    tier is "" for every tier); ``stored`` / ``removed`` / ``cleared`` summarise them."""

    cleared: bool = False
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    skipped: int = 0  # blocks that could not be keyed (unknown parent, other block size, extra keys)
    ops: list[tuple[str, list[int], str]] = field(default_factory=list)
    learned: list[tuple[Hashable, int]] = field(default_factory=list)  # (vLLM block hash, our key) of stored blocks
    cleared_tiers: tuple[str, ...] = ()  # the tiers an AllBlocksCleared emptied
    runs: list[StoredRun] = field(default_factory=list)  # the stored blocks with their tokens, in event order

    def apply_to(self, worker: str, index: IndexLike) -> None:
        """Apply the ops to ``index``, each tier's blocks under its holder (:func:`holder_of`)."""
        for op, keys, tier in self.ops:
            if op == "stored":
                index.blocks_stored(holder_of(worker, tier), keys)
            elif op == "removed":
                index.blocks_removed(holder_of(worker, tier), keys)
            else:
                for t in self.cleared_tiers:
                    index.all_cleared(holder_of(worker, t))


class IndexLike(Protocol):
    def blocks_stored(self, holder: str, keys: list[int]) -> None: ...

    def blocks_removed(self, holder: str, keys: list[int]) -> None: ...

    def all_cleared(self, holder: str) -> None: ...


def decode_batch(payload: bytes) -> list[dict[str, Any]]:
    """The events of one published batch (raises ValueError when the payload is not a KV event batch)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types on garbage
        raise ValueError(f"not a msgpack KV event batch: {e}") from None
    if not isinstance(obj, (list, tuple)) or len(obj) < 2 or not isinstance(obj[1], list):
        raise ValueError("KV event batch must be [ts, [events...], ...]")
    return [e for e in obj[1] if isinstance(e, dict)]


def _h(x: Any) -> Hashable:
    return bytes(x) if isinstance(x, (bytes, bytearray)) else x


class EventTranslator:
    """One per worker (publisher)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.keys: dict[Hashable, int] = {}  # vLLM block hash -> our key, of the device's blocks
        self.tiers: dict[str, dict[Hashable, int]] = {DEVICE: self.keys}  # the same, per tier
        self.last_seq: int | None = None
        self.last_digest = b""  # the feed's digest of batch last_seq (a snapshot's resume check)

    def sequence(self, seq: int) -> bool:
        """Record a batch's sequence number; True when batches were lost or the publisher restarted."""
        lost = self.last_seq is not None and seq != self.last_seq + 1
        self.last_seq = seq
        if lost:
            self._forget()
        return lost

    def held_tiers(self) -> tuple[str, ...]:
        """The tiers this worker has published blocks in (the device always)."""
        return tuple(self.tiers)

    def _forget(self) -> None:
        for m in self.tiers.values():
            m.clear()

    def _parent(self, h: Hashable) -> int | None:
        """Our key of a parent block, on whichever tier it was stored (the device first)."""
        found = self.keys.get(h)
        if found is None:
            for m in self.tiers.values():
                found = m.get(h)
                if found is not None:
                    break
        return found

    def apply(self, events: list[dict[str, Any]]) -> IndexUpdate:
        up = IndexUpdate()
        for ev in events:
            kind = ev.get("type")
            if kind == "BlockStored":
                self._stored(ev, up)
            elif kind == "BlockRemoved":
                tier = tier_of_medium(ev.get("medium"))
                m = self.tiers.get(tier) if tier is not None else None
                if tier is None or m is None:
                    continue
                gone = [k for k in (m.pop(_h(h), None) for h in ev.get("block_hashes") or []) if k is not None]
                up.removed.extend(gone)
                if gone:
                    up.ops.append(("removed", gone, tier))
            elif kind == "AllBlocksCleared":
                up.cleared_tiers = self.held_tiers()
                self._forget()
                up.cleared = True
                up.stored.clear()
                up.removed.clear()
                up.ops = [("cleared", [], "")]
        return up

    def _stored(self, ev: dict[str, Any], up: IndexUpdate) -> None:
        hashes = ev.get("block_hashes") or []
        tokens = ev.get("token_ids") or []
        bs = ev.get("block_size")
        parent_h = ev.get("parent_block_hash")
        salt = _domain_salt(ev, len(hashes), parent_h is None)
        tier = tier_of_medium(ev.get("medium"))
        if bs != self.block_size or len(tokens) != len(hashes) * self.block_size or salt is False or tier is None:
            up.skipped += len(hashes)
            return
        if parent_h is None:
            lora = ev.get("lora_name")
            parent = domain_root(salt if isinstance(salt, str) else None, lora if isinstance(lora, str) else None)
        else:
            found = self._parent(_h(parent_h))
            if found is None:
                up.skipped += len(hashes)
                return
            parent = found
        mine = self.tiers.setdefault(tier, {})
        start = parent
        new = []
        for i, h in enumerate(hashes):
            parent = block_key(parent, tokens[i * bs:(i + 1) * bs])
            mine[_h(h)] = parent
            new.append(parent)
            up.learned.append((_h(h), parent))
        up.stored.extend(new)
        up.ops.append(("stored", new, tier))
        up.runs.append(StoredRun(start, parent_h is None, new, tokens))  # (no copies: the router's feed too)


def _domain_salt(ev: dict[str, Any], blocks: int, first: bool) -> str | bool:
    """The cache salt of a stored run of blocks ("" without one), or False when its extra keys hold anything
    but the LoRA name (every block) and the salt (the request's first block only)."""
    extra = ev.get("extra_keys")
    if not extra:
        return ""
    lora = ev.get("lora_name")
    head = [lora] if isinstance(lora, str) and lora else []
    salt = ""
    for i in range(blocks):
        keys = list(extra[i] or []) if i < len(extra) else []
        if keys[:len(head)] != head:
            return False
        rest = keys[len(head):]
        if i == 0 and first and len(rest) == 1 and isinstance(rest[0], str):
            salt = rest[0]
        elif rest:
            return False
    return salt
