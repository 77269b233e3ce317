"""Workers kept in load order as their load changes: the candidate bound that makes one placement independent
of the fleet's size.

A fixed-role placement (:meth:`pdserve.conductor.policy.Conductor.place`, policy ``conductor``) predicts TTFT only
for the prefill workers that hold a prefix of the prompt (the prefix index answers that from the prompt's block
keys, :mod:`.index`) plus the ``k`` least-loaded prefill workers, and TPOT only for the ``k`` least-loaded decode
workers. A :class:`LoadOrder` keeps each group sorted by a load key that only changes when a request is placed on,
moved to or released from a worker (never with the clock), so it is re-keyed there, one worker at a time: a
binary search plus one C-level list insert/delete per change, and reading the ``k`` least-loaded is ``k`` steps
(plus the workers skipped because they are excluded or at their in-flight limit).

The keys:

- prefill: (predicted seconds of the prefills queued there, their uncached tokens, worker id) -- an upper bound of
  its queue (the running prefill's elapsed time is not subtracted), ordered as the placement breaks its ties;
- decode: (decodes placed there, the KV tokens they may occupy, worker id).

With router replicas the others' load on a worker (:class:`~.load.Others`) is in both keys; it changes with a
worker's report, which re-keys that worker.

What the bound may miss is said in docs/conductor.md ("Placement at fleet scale").
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable

from .load import WorkerLoad

SHORTLIST = 32  # least-loaded candidates per role; a fleet with at most this many per role is seen whole

Key = tuple[float, float, str]


def prefill_key(w: WorkerLoad) -> Key:
    """Queued prefill seconds (not less the running one's elapsed time), then queued tokens, then the id."""
    return (sum(j.predicted_s for j in w.prefills.values()) + w.others_prefills * w.mean_prefill_s,
            float(w.queued_prefill_tokens()), w.worker_id)


def decode_key(w: WorkerLoad) -> Key:
    """Decodes placed there, then the KV tokens they may occupy, then the id."""
    return (float(w.running_decodes()), float(sum(j.kv_tokens for j in w.decodes.values())), w.worker_id)


class LoadOrder:
    """A group of workers sorted by ``key`` (least loaded first), re-keyed one worker at a time."""

    def __init__(self, key: Callable[[WorkerLoad], Key]) -> None:
        self._key = key
        self._sorted: list[Key] = []
        self._keys: dict[str, Key] = {}
        self._workers: dict[str, WorkerLoad] = {}

    def __len__(self) -> int:
        return len(self._sorted)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._keys

    def update(self, w: WorkerLoad) -> None:
        """Insert w, or move it to where its load now puts it."""
        new = self._key(w)
        old = self._keys.get(w.worker_id)
        self._workers[w.worker_id] = w
        if old == new:
            return
        if old is not None:
            self._drop(old)
        insort(self._sorted, new)
        self._keys[w.worker_id] = new

    def discard(self, worker_id: str) -> None:
        old = self._keys.pop(worker_id, None)
        self._workers.pop(worker_id, None)
        if old is not None:
            self._drop(old)

    def _drop(self, key: Key) -> None:
        i = bisect_left(self._sorted, key)
        assert self._sorted[i] == key
        del self._sorted[i]

    def least(self, k: int, ok: Callable[[WorkerLoad], bool]) -> list[WorkerLoad]:
        """The ``k`` least-loaded workers for which ``ok`` holds, least loaded first."""
        out: list[WorkerLoad] = []
        for key in self._sorted:
            w = self._workers[key[2]]
            if ok(w):
                out.append(w)
                if len(out) >= k:
                    break
        return out

    def all(self) -> list[WorkerLoad]:
        """Every worker of the group, least loaded first."""
        return [self._workers[key[2]] for key in self._sorted]
