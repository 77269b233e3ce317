"""Prefix index: which holder (worker, or pool tier) holds which KV block, by chained block key.

Keys are :func:`pdserve.hashing.block_hashes` of token ids, so a key stands for a whole prefix. A holder's usable
prefix for a prompt is the run of leading keys it holds (vLLM, like the pool, can only reuse a block whose
whole prefix is cached). Lookup walks the prompt's keys once, intersecting holder sets: time proportional to
blocks x holders of the first block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._keys: dict[str, set[int]] = {}

    def __len__(self) -> int:
        """Number of distinct indexed block keys."""
        return len(self._holders)

    def holders(self) -> list[str]:
        return sorted(self._keys)

    def blocks_of(self, holder: str) -> int:
        return len(self._keys.get(holder, ()))

    def keys_of(self, holder: str) -> set[int]:
        """The keys ``holder`` holds (the index's own set: do not change it)."""
        return self._keys.get(holder, set())

    def holders_at(self, key: int) -> set[str]:
        """The holders of ``key`` (the index's own set: do not change it)."""
        return self._holders.get(key, set())

    def holds(self, holder: str, key: int) -> bool:
        return holder in self._holders.get(key, ())

    def stored(self, holder: str, keys: Iterable[int]) -> None:
        mine = self._keys.setdefault(holder, set())
        for k in keys:
            self._holders.setdefault(k, set()).add(holder)
            mine.add(k)

    def removed(self, holder: str, keys: Iterable[int]) -> None:
        mine = self._keys.get(holder)
        if mine is None:
            return
        for k in keys:
            mine.discard(k)
            hs = self._holders.get(k)
            if hs is not None:
                hs.discard(holder)
                if not hs:
                    del self._holders[k]

    def cleared(self, holder: str) -> None:
        """Forget everything ``holder`` held (AllBlocksCleared, restart, removal)."""
        for k in self._keys.pop(holder, ()):
            hs = self._holders.get(k)
            if hs is not None:
                hs.discard(holder)
                if not hs:
                    del self._holders[k]

    def prefix_lengths(self, keys: Sequence[int]) -> dict[str, int]:
        """holder -> number of leading ``keys`` it holds (holders with none are absent)."""
        if not keys:
            return {}
        alive = set(self._holders.get(keys[0], ()))
        out: dict[str, int] = {}
        for i in range(1, len(keys)):
            if not alive:
                return out
            nxt = self._holders.get(keys[i])
            if nxt is None:
                for h in alive:
                    out[h] = i
                return out
            for h in alive - nxt:
                out[h] = i
            alive &= nxt
        for h in alive:
            out[h] = len(keys)
        return out
