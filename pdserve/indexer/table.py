"""The indexer's table: every owner's blocks by tier (one :class:`~pdserve.conductor.index.PrefixIndex` whose
holders are :func:`~pdserve.conductor.tiers.holder_of` names), the placeholders of fresh placements, and the
lookups by block keys per owner and tier.

It is the ``IndexLike`` the KV event feed, the pool follower and the Mooncake Store view apply their updates to,
so the same translators and rules the router uses in-process fill it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ..conductor.index import PrefixIndex
from ..conductor.tiers import DEVICE, split_holder
from .placeholders import TIER as PLACEHOLDER
from .placeholders import Placeholders

LONGEST = "longest"  # a lookup's leading blocks held in any one owner's tiers, together


class TieredIndex:
    def __init__(self, clock: Callable[[], float], placeholder_ttl_s: float = 10.0) -> None:
        self.index = PrefixIndex()
        self.placeholders = Placeholders(placeholder_ttl_s)
        self.clock = clock
        self.holders_of: dict[str, set[str]] = {}  # owner -> its holder names, one per tier it ever stored in
        self.names: dict[str, tuple[str, str]] = {}  # holder -> (owner, tier), memoised for lookups

    # ---- updates (IndexLike) ----
    def blocks_stored(self, holder: str, keys: list[int]) -> None:
        self.index.stored(holder, keys)
        owner, tier = split_holder(holder)
        self.holders_of.setdefault(owner, set()).add(holder)
        if tier == DEVICE:
            self.placeholders.confirm(owner, keys)

    def blocks_removed(self, holder: str, keys: list[int]) -> None:
        self.index.removed(holder, keys)

    def all_cleared(self, holder: str) -> None:
        self.index.cleared(holder)
        owner, tier = split_holder(holder)
        if tier == DEVICE:
            self.placeholders.clear(owner)

    def forget_owner(self, owner: str) -> None:
        """Drop every tier of ``owner`` (it left)."""
        for h in self.index.holders():
            if split_holder(h)[0] == owner:
                self.index.cleared(h)
        self.placeholders.clear(owner)

    def expect(self, worker: str, keys: Iterable[int]) -> int:
        """A placement just sent these blocks' prompt to ``worker``: placeholders until its event (or expiry)."""
        return self.placeholders.add(worker, keys, self.clock())

    # ---- reads ----
    def entries(self) -> int:
        """(holder, block) entries: a block held in two tiers or by two workers counts twice."""
        return sum(self.index.blocks_of(h) for h in self.index.holders())

    def blocks(self) -> dict[str, dict[str, int]]:
        """owner -> tier -> blocks held."""
        out: dict[str, dict[str, int]] = {}
        for h in self.index.holders():
            owner, tier = split_holder(h)
            out.setdefault(owner, {})[tier] = self.index.blocks_of(h)
        return out

    def lookup(self, keys: Sequence[int], owners: Iterable[str] | None = None,
               tiers: Iterable[str] | None = None) -> dict[str, dict[str, int]]:
        """owner -> {tier: leading ``keys`` held in that tier, ..., ``longest``: leading keys held in any of its
        tiers together, ``placeholder``: leading keys held or expected from a fresh placement, when that is
        more}; owners holding none are absent. ``owners`` / ``tiers`` narrow the answer."""
        want_o = set(owners) if owners is not None else None
        want_t = set(tiers) if tiers is not None else None
        out: dict[str, dict[str, int]] = {}
        names = self.names
        for h, n in self.index.prefix_lengths(keys).items():
            name = names.get(h)
            if name is None:
                name = names[h] = split_holder(h)
            owner, tier = name
            if (want_o is None or owner in want_o) and (want_t is None or tier in want_t):
                per = out.get(owner)
                if per is None:
                    out[owner] = {tier: n}
                else:
                    per[tier] = n
        end = len(keys)
        for owner, per in out.items():
            m = max(per.values())
            if m < end:
                mine = self.holders_of.get(owner, ())
                if len(mine) > 1 and not self.index.holders_at(keys[m]).isdisjoint(mine):
                    m = self._longest(mine, keys, m + 1)
            per[LONGEST] = m
        if (want_t is None or PLACEHOLDER in want_t) and self.placeholders.entries:
            self.placeholders.expire(self.clock())
            for w in self.placeholders.workers_at(keys):
                if want_o is not None and w not in want_o:
                    continue
                per = out.get(w, {LONGEST: 0})
                i = per[LONGEST]
                while i < len(keys) and self.placeholders.holds(w, keys[i]):
                    i += 1
                if i > per[LONGEST]:
                    per[PLACEHOLDER] = i
                    out[w] = per
        return out

    def _longest(self, mine: set[str], keys: Sequence[int], start: int) -> int:
        """Leading keys held by any of one owner's holders ``mine``, given the first ``start`` are."""
        i = start
        at = self.index.holders_at
        while i < len(keys) and not at(keys[i]).isdisjoint(mine):
            i += 1
        return i
