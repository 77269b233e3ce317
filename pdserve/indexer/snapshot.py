"""Snapshots of the indexer: what each worker's stream has told it, with the exact point to resume it from.

A worker's entries are exactly its translator's state (per tier, vLLM block hash -> pdserve key: a block in it is
held, a removed one is not), so a snapshot stores, per worker, that state, the sequence number of the last batch
applied and that batch's digest; and, for the KV pool, the master's epoch, the event position read up to and the
pooled keys. Taken between two batches on the event loop, it is consistent: every entry reflects exactly the
batches up to ``last_seq``.

Restoring rebuilds the translators and the index, then resumes each worker's stream from its ``last_seq``
(:meth:`~pdserve.router.fleet.kv_events.KVEventFeed.resume`): the worker's replay buffer still holding that
batch, with the same digest, proves it is the same stream, and the batches after it are applied once each.
Otherwise (the buffer moved on, the worker restarted) that worker alone is re-learned from its replay (the
clear-on-gap rule). The pool resumes its event log from the stored position under the same epoch, else
resyncs. Placeholders are not stored (their life is seconds).

File: one msgpack map (no pickle), written to a temporary name and renamed over the last one. Hashes and keys
travel as packed little-endian arrays (uint64; vLLM's byte hashes as fixed-width rows), not as lists.
"""

from __future__ import annotations

import os
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ..conductor.events import EventTranslator

VERSION = 1


def pack_hashes(hashes: list[Hashable]) -> dict[str, Any]:
    """vLLM block hashes as one packed array: uint64 when they are ints, fixed-width rows when bytes."""
    if not hashes:
        return {"kind": "u64", "data": b""}
    first = hashes[0]
    if isinstance(first, int):
        try:
            return {"kind": "u64", "data": np.fromiter(hashes, dtype="<u8", count=len(hashes)).tobytes()}
        except (TypeError, OverflowError, ValueError):
            pass
    elif isinstance(first, bytes):
        width = len(first)
        if all(type(h) is bytes and len(h) == width for h in hashes):
            return {"kind": "bytes", "width": width, "data": b"".join(hashes)}  # type: ignore[arg-type]
    return {"kind": "list", "data": list(hashes)}


def unpack_hashes(packed: dict[str, Any]) -> list[Hashable]:
    kind, data = packed["kind"], packed["data"]
    if kind == "u64":
        return list(np.frombuffer(data, dtype="<u8").tolist())
    if kind == "bytes":
        w = int(packed["width"])
        return [data[i:i + w] for i in range(0, len(data), w)]
    return [bytes(h) if isinstance(h, (bytes, bytearray)) else h for h in data]


def _keys(keys: Any) -> bytes:
    return np.fromiter(keys, dtype="<u8", count=len(keys)).tobytes()


def capture_stream(worker: str, endpoint: str, replay: str, tr: EventTranslator) -> dict[str, Any]:
    """One worker's stream state (its translator, which is its entries, and its resume point)."""
    tiers = {tier: {"hashes": pack_hashes(list(m.keys())), "keys": _keys(list(m.values()))}
             for tier, m in tr.tiers.items()}
    return {"worker": worker, "endpoint": endpoint, "replay": replay, "block_size": tr.block_size,
            "last_seq": tr.last_seq, "digest": tr.last_digest, "tiers": tiers}


def restore_translator(stream: dict[str, Any]) -> EventTranslator:
    tr = EventTranslator(int(stream["block_size"]))
    for tier, t in stream["tiers"].items():
        keys = np.frombuffer(t["keys"], dtype="<u8").tolist()
        m = dict(zip(unpack_hashes(t["hashes"]), keys))
        if tier in tr.tiers:
            tr.tiers[tier].update(m)
        else:
            tr.tiers[tier] = m
    tr.last_seq = stream["last_seq"]
    tr.last_digest = bytes(stream["digest"])
    return tr


def capture_pool(epoch: str | None, since: int, keys: set[int], disk_keys: set[int]) -> dict[str, Any]:
    """The pool's log position and its keys per tier (memory; ``disk_keys``: on a node's SSD only)."""
    return {"epoch": epoch, "since": since, "keys": _keys(list(keys)), "disk_keys": _keys(list(disk_keys))}


def pool_keys(pool: dict[str, Any]) -> list[int]:
    return list(np.frombuffer(pool["keys"], dtype="<u8").tolist())


def pool_disk_keys(pool: dict[str, Any]) -> list[int]:
    """The pool's disk-tier keys (none in a snapshot taken before the pool's tiers were logged)."""
    return list(np.frombuffer(pool.get("disk_keys", b""), dtype="<u8").tolist())


def document(streams: list[dict[str, Any]], pool: dict[str, Any] | None,
             xxh3: dict[str, Any] | None = None) -> dict[str, Any]:
    """The snapshot: each stream, the pool's position and keys, and the XXH3 map (pdserve.indexer.xxh3_keys)."""
    return {"version": VERSION, "taken_at": time.time(), "streams": streams, "pool": pool, "xxh3": xxh3}


def encode(doc: dict[str, Any]) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def decode(data: bytes, where: str = "snapshot") -> dict[str, Any]:
    """A snapshot document from its bytes; ValueError when they are not one of this version."""
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types on garbage
        raise ValueError(f"{where}: not an indexer snapshot ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("streams"), list):
        raise ValueError(f"{where}: not an indexer snapshot of version {VERSION}")
    return doc


def write(path: str | Path, doc: dict[str, Any]) -> int:
    """Write ``doc`` atomically (temporary file, fsync, rename); returns its size in bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = encode(doc)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(data)


def read(path: str | Path) -> dict[str, Any] | None:
    """The snapshot at ``path``; None when there is none. Raises ValueError on a file that is not one."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    return decode(data, str(path))
