"""The one owner of a finished request's held KV blocks on the worker (P's blocks, and any request's
blocks while they are saved to the KV pool).

vLLM frees a finished request's blocks when ``request_finished`` returns ``delay_free=False``; with
``delay_free=True`` it waits until the worker reports the request in ``finished_sending``. A request is
held for up to two reasons, both known to the worker from the scheduler's per-step metadata:

* a **lease** (P, the request had ``do_remote_decode``): until D's READ batch notification names the
  request (``NOTIFIED``) or the lease deadline passes (``LEASE``), whichever comes first;
* a **pool save**: until the worker's ``StoreClient.put`` of the blocks has ended (stored or failed).

:class:`ReleaseLedger` is released-exactly-once bookkeeping over both: a request is reported once, when
its last hold ends; each lease ends once and is counted once, by reason. A notification that arrives
before the worker learns of the lease (D can read as soon as P's scheduler answered) is kept for
``early_ttl_s`` and ends the lease when it arrives; one for a request no longer held is kept the same way
and expires unused. Ids the ledger never held are never reported.

Tensor parallelism: each rank has its own ledger for its own shard of the blocks. Several D ranks may read one
P rank's shard (a D with more ranks than P); each notification says how many readers to expect, and the lease
ends ``NOTIFIED`` once that many distinct readers have notified (or ``LEASE`` at the deadline).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pdserve.vllm.messages import LEASE, NOTIFIED


@dataclass
class _Hold:
    deadline: float | None = None  # lease deadline (time.time()); None = no lease
    lease_ended: str = ""  # "" while the lease runs (or there is none); NOTIFIED | LEASE once it ended
    saving: bool = False

    def leased(self) -> bool:
        return self.deadline is not None and not self.lease_ended


@dataclass
class _Note:
    seen: float  # when the first notification arrived
    readers: int = 1  # how many distinct D ranks will notify
    senders: set[int] = field(default_factory=set)

    def complete(self) -> bool:
        return len(self.senders) >= self.readers


@dataclass
class Released:
    """One step's outcome: what to report to vLLM and which leases ended (and why)."""

    finished_sending: set[str] = field(default_factory=set)  # free these requests' blocks now
    lease_ends: dict[str, str] = field(default_factory=dict)  # request id -> NOTIFIED | LEASE


class ReleaseLedger:
    """Decides when each held request's blocks are released. Thread-safe: ``notify`` is called from the
    transfer engine's thread, everything else from the worker's step."""

    def __init__(self, early_ttl_s: float = 600.0) -> None:
        self.early_ttl_s = early_ttl_s
        self._holds: dict[str, _Hold] = {}
        self._notes: dict[str, _Note] = {}  # notified request id -> its notifications, until a step applies them
        self._counts = {NOTIFIED: 0, LEASE: 0}  # lease ends since the last take_counts()
        self._lock = threading.Lock()

    # ---- holds ----
    def lease(self, req_id: str, deadline: float) -> None:
        """P keeps the request's blocks for a decode read until ``deadline`` (its wall clock)."""
        with self._lock:
            hold = self._holds.setdefault(req_id, _Hold())
            if hold.deadline is None:  # a repeated lease changes nothing
                hold.deadline = deadline

    def saving(self, req_id: str) -> None:
        """A pool save of the request's blocks has started."""
        with self._lock:
            self._holds.setdefault(req_id, _Hold()).saving = True

    # ---- events ----
    def notify(self, req_id: str, now: float | None = None, sender: int = 0, readers: int = 1) -> None:
        """D rank ``sender``'s READ notification (``remote_request_id``) for ``req_id`` arrived, one of
        ``readers``; the next step applies it once every reader has notified."""
        with self._lock:
            note = self._notes.setdefault(req_id, _Note(time.time() if now is None else now, max(1, readers)))
            note.senders.add(sender)

    def save_done(self, req_id: str) -> None:
        """The request's pool save has ended (stored or failed: the pool is a cache)."""
        with self._lock:
            hold = self._holds.get(req_id)
            if hold is not None:
                hold.saving = False

    # ---- per step ----
    def step(self, now: float | None = None) -> Released:
        """End the leases that are over (notified, or past their deadline at ``now``), then release every
        request with no hold left. A notification for a request not leased now waits up to
        ``early_ttl_s`` for its lease."""
        now = time.time() if now is None else now
        out = Released()
        with self._lock:
            for req_id, hold in list(self._holds.items()):
                if hold.leased():
                    note = self._notes.get(req_id)
                    if note is not None and note.complete():
                        del self._notes[req_id]
                        hold.lease_ended = NOTIFIED
                    elif now >= hold.deadline:  # type: ignore[operator]
                        hold.lease_ended = LEASE
                    else:
                        continue
                    out.lease_ends[req_id] = hold.lease_ended
                    self._counts[hold.lease_ended] += 1
                if not hold.saving:
                    out.finished_sending.add(req_id)
                    del self._holds[req_id]
            for req_id, note in list(self._notes.items()):
                if now - note.seen > self.early_ttl_s:
                    del self._notes[req_id]
        return out

    def take_counts(self) -> dict[str, int]:
        """Leases ended since the last call, by reason (``NOTIFIED``, ``LEASE``); each counted once."""
        with self._lock:
            out, self._counts = self._counts, {NOTIFIED: 0, LEASE: 0}
        return out

    def held(self) -> set[str]:
        """Requests whose blocks are still held."""
        with self._lock:
            return set(self._holds)
