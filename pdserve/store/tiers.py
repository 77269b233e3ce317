"""Storage tiers of a KV pool node: a host-memory arena (one registered buffer, carved by an allocator the
master runs) and an SSD tier (one real file per object in a directory, with its own byte bound).

The arena allocator is pure bookkeeping over offsets: it never touches the bytes, so the master can run one
per node and a node can rebuild nothing but its catalog after a restart.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Iterator
from pathlib import Path

ALIGN = 64  # object starts are cache-line aligned; sizes are rounded up to this


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class ArenaAllocator:
    """First-fit allocator over ``[0, capacity)`` with a sorted, coalescing free list.

    ``alloc`` returns the lowest free offset that fits (sizes are rounded up to ``align``), ``free`` gives a
    range back and merges it with its neighbours, ``reserve`` marks a known range used (re-registration after
    a master restart). O(free ranges) per call; the free list stays short because neighbours always merge.
    """

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        if capacity <= 0:
            raise ValueError(f"arena capacity {capacity}: must be positive")
        self.capacity = capacity
        self.align = align
        self._starts: list[int] = [0]  # free ranges, sorted by start, never adjacent
        self._ends: list[int] = [capacity]
        self.used = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def alloc(self, size: int) -> int | None:
        need = round_up(max(size, 1), self.align)
        for i, (s, e) in enumerate(zip(self._starts, self._ends)):
            if e - s >= need:
                if e - s == need:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = s + need
                self.used += need
                return s
        return None

    def free(self, offset: int, size: int) -> None:
        n = round_up(max(size, 1), self.align)
        end = offset + n
        if offset < 0 or end > self.capacity:
            raise ValueError(f"free [{offset}, {end}) outside arena of {self.capacity} bytes")
        i = bisect.bisect_left(self._starts, offset)
        if (i < len(self._starts) and self._starts[i] < end) or (i > 0 and self._ends[i - 1] > offset):
            raise ValueError(f"double free: [{offset}, {end}) overlaps a free range")
        merge_left = i > 0 and self._ends[i - 1] == offset
        merge_right = i < len(self._starts) and self._starts[i] == end
        if merge_left and merge_right:
            self._ends[i - 1] = self._ends[i]
            del self._starts[i], self._ends[i]
        elif merge_left:
            self._ends[i - 1] = end
        elif merge_right:
            self._starts[i] = offset
        else:
            self._starts.insert(i, offset)
            self._ends.insert(i, end)
        self.used -= n

    def reserve(self, offset: int, size: int) -> bool:
        """Mark ``[offset, offset+size)`` used if it is wholly free; False if any of it is taken."""
        n = round_up(max(size, 1), self.align)
        end = offset + n
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or self._ends[i] < end or offset % self.align:
            return False
        s, e = self._starts[i], self._ends[i]
        pieces = [(a, b) for a, b in ((s, offset), (end, e)) if b > a]
        del self._starts[i], self._ends[i]
        for a, b in reversed(pieces):
            self._starts.insert(i, a)
            self._ends.insert(i, b)
        self.used += n
        return True

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))


class DiskTier:
    """One file per object (``<key as 16 hex digits>.kv``) in ``directory``, at most ``capacity`` bytes.

    Writes go to a temporary name and are renamed into place, so a crash never leaves a torn object; a node
    that restarts finds its objects again with :meth:`scan`. Thread-safe.
    """

    SUFFIX = ".kv"

    def __init__(self, directory: str | os.PathLike, capacity: int) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)

    def path(self, key: int) -> Path:
        return self.dir / f"{key:016x}{self.SUFFIX}"

    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def scan(self) -> Iterator[tuple[int, int]]:
        """(key, size) of every object file in the directory (adopted into this tier's accounting)."""
        for p in sorted(self.dir.glob(f"*{self.SUFFIX}")):
            try:
                key = int(p.stem, 16)
                size = p.stat().st_size
            except (ValueError, OSError):
                continue
            with self._lock:
                if key not in self._sizes and sum(self._sizes.values()) + size > self.capacity:
                    p.unlink(missing_ok=True)  # over the bound (capacity lowered since): drop it
                    continue
                self._sizes[key] = size
            yield key, size

    def write(self, key: int, data: memoryview) -> None:
        size = data.nbytes
        with self._lock:
            if key in self._sizes:
                return
            if sum(self._sizes.values()) + size > self.capacity:
                raise OSError(f"SSD tier full: {size} more bytes would exceed its {self.capacity}-byte bound")
            self._sizes[key] = size  # reserved while writing
        tmp = self.dir / f"{key:016x}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb", buffering=0) as f:
                view = data
                while view.nbytes:
                    n = f.write(view)
                    view = view[n:]
            os.replace(tmp, self.path(key))
        except BaseException:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._sizes.pop(key, None)
            raise

    def read_into(self, key: int, out: memoryview) -> int:
        """Read the object into ``out`` (its exact size); return the bytes read."""
        with open(self.path(key), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != out.nbytes:
                raise OSError(f"object {key:016x} holds {size} bytes on disk, {out.nbytes} were expected")
            got = 0
            while got < size:
                n = f.readinto(out[got:])
                if not n:
                    raise OSError(f"object {key:016x}: file ended after {got} of {size} bytes")
                got += n
        return got

    def remove(self, key: int) -> None:
        with self._lock:
            self._sizes.pop(key, None)
        self.path(key).unlink(missing_ok=True)

    def __contains__(self, key: int) -> bool:
        with self._lock:
            return key in self._sizes
