"""P, worker side: the rendezvous of an early hand-off (docs/architecture.md, section 3, "Early dispatch").

The router sends D its request while P is still prefilling, with a hand-off id (``pdserve_handoff``, minted by the
router, also in P's ``kv_transfer_params``). D's worker asks P's transfer engine for that id (a notification that P
answers, :data:`WAIT_PREFIX`); P's worker answers once its scheduler has said, in the step whose forward completes
the prompt, which blocks hold it (:class:`~pdserve.vllm.messages.ReadyNote`, after their seal when checksums are
on): P's request id, the block ids, the prompt's digest and P's fingerprint. D then reads as after a serial
hand-off, and its READ notification (naming P's request id) ends P's lease.

Layer by layer (``layerwise_kv``): the scheduler's note reaches the worker before the forward that completes the
prompt (``begin``), and as each layer's attention writes it the model's thread marks that layer ready (``layer``: a
bit set under the board's lock, nothing else on the forward's path). D asks :data:`LAYERS_PREFIX` with the layers it
has; P answers as soon as it has others (or the forward ended: ``ready``), with the set of layers ready and whether
the forward is done; the worker adds the new layers' checksums, computed on the engine's thread that answers.

:class:`HandoffBoard` is that table: ids announced ready (or gone: P's request ended before its prompt was
computed), the waiters, and the notifications that named an id instead of P's request id (D gave up, or was
aborted, before it learnt P's request id): those end the lease as soon as the id is known. Entries expire after
``ttl_s``. Thread-safe: ``wait`` and ``note`` run on the transfer engine's connection threads, ``ready`` and
``gone`` on the worker's step.

No vLLM or torch import.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.vllm.messages import ReadyNote
from pdserve.vllm.params import HANDOFF_PREFIX  # every hand-off id starts so: not a P request id

__all__ = ["HANDOFF_PREFIX", "LAYERS_PREFIX", "MAX_WAIT_S", "TOKEN_PREFIX", "WAIT_PREFIX", "HandoffBoard",
           "LayersQuestion", "is_handoff", "layers_message", "parse_layers", "parse_wait", "wait_message"]
WAIT_PREFIX = "?wait|"  # D's question: "?wait|<hand-off id>|<P's engine id>|<seconds>"
# D's layer-wise question: "?layers|<hand-off id>|<P's engine id>|<seconds>|<layers D has, hex mask>|<first>|<end>
# [|<need>]" (first, end: the positions of P's prompt blocks D reads, whose checksums P answers; need: how many new
# layers P waits for before it answers, 1 when absent; the forward's end answers whatever is new)
LAYERS_PREFIX = "?layers|"
# D's second question, where it continues after P's first token (pdserve.vllm.continuation): the same fields; P
# answers once it sampled that token (or that there is none to continue after)
TOKEN_PREFIX = "?tok|"
MAX_WAIT_S = 600.0  # P never holds a question longer than this, whatever D asks


def is_handoff(name: str) -> bool:
    return name.startswith(HANDOFF_PREFIX)


def wait_message(handoff: str, engine_id: str, wait_s: float, prefix: str = WAIT_PREFIX) -> str:
    return f"{prefix}{handoff}|{engine_id}|{wait_s:.3f}"


def parse_wait(msg: str, prefix: str = WAIT_PREFIX) -> tuple[str, str, float] | None:
    """(hand-off id, P engine id D expects, seconds) of a question (``prefix``: which one), or None when ``msg`` is
    not one."""
    if not msg.startswith(prefix):
        return None
    parts = msg[len(prefix):].split("|")
    if len(parts) != 3 or not is_handoff(parts[0]):
        return None
    try:
        wait_s = float(parts[2])
    except ValueError:
        return None
    return parts[0], parts[1], min(max(wait_s, 0.0), MAX_WAIT_S)


@dataclass(frozen=True)
class LayersQuestion:
    """D's layer-wise question, parsed: answer once P has layers not in ``have`` (a bit per P layer region)."""

    handoff: str
    engine_id: str
    wait_s: float
    have: int
    first: int  # D reads P's prompt blocks [first, end)
    end: int
    need: int = 1  # new layers P waits for before answering (the forward's end answers at once)


def layers_message(handoff: str, engine_id: str, wait_s: float, have: int, first: int, end: int, need: int = 1) -> str:
    return f"{LAYERS_PREFIX}{handoff}|{engine_id}|{wait_s:.3f}|{have:x}|{first}|{end}|{max(1, need)}"


def parse_layers(msg: str) -> LayersQuestion | None:
    """The question in ``msg``, or None when it is not one (or malformed)."""
    if not msg.startswith(LAYERS_PREFIX):
        return None
    parts = msg[len(LAYERS_PREFIX):].split("|")
    if len(parts) not in (6, 7) or not is_handoff(parts[0]):
        return None
    try:
        wait_s, have, first, end = float(parts[2]), int(parts[3], 16), int(parts[4]), int(parts[5])
        need = int(parts[6]) if len(parts) == 7 else 1
    except ValueError:
        return None
    if have < 0 or not 0 <= first <= end or need < 1:
        return None
    return LayersQuestion(parts[0], parts[1], min(max(wait_s, 0.0), MAX_WAIT_S), have, first, end, need)


@dataclass
class _Entry:
    since: float
    cond: threading.Condition  # over the board's lock: wakes this hand-off's waiters only
    note: ReadyNote | None = None
    gone: str = ""  # why P will never announce it
    token_done: bool = False  # P's first token is in ``note``, or P said there is none (D continues after it)
    pending: list[tuple[int, int]] = field(default_factory=list)  # (sender, readers) of notes naming the id
    early: ReadyNote | None = None  # known before the forward that completes the prompt (layer-wise)
    layers: int = 0  # layers that forward has written so far, a bit per layer region
    waits: list[tuple[int, int]] = field(default_factory=list)  # (have, need) of the layer questions waiting

    def enough(self, have: int, need: int) -> bool:
        """Whether ``need`` layers not in ``have`` are written."""
        return bin(self.layers & ~have).count("1") >= need

    def answers(self) -> bool:
        """Whether a layer question waiting on this entry can be answered now."""
        return any(self.enough(have, need) for have, need in self.waits)


class HandoffBoard:
    """One per P worker rank (see the module docstring). ``on_note(p_request_id, sender, readers)``: how a
    notification that named a hand-off id reaches the lease ledger once P's request id is known."""

    def __init__(self, engine_id: str, on_note: Callable[[str, int, int], None], ttl_s: float = 600.0) -> None:
        self.engine_id = engine_id
        self.on_note = on_note
        self.ttl_s = ttl_s
        self._entries: dict[str, _Entry] = {}
        # one lock; each entry's condition wakes only its own waiters, so a layer written during P's forward wakes
        # no thread unless a question it answers waits (each wake-up is time the forward's thread waits for P's
        # core and the GIL)
        self._lock = threading.Lock()

    def _entry(self, handoff: str, now: float) -> _Entry:
        entry = self._entries.get(handoff)
        if entry is None:
            entry = self._entries[handoff] = _Entry(now, threading.Condition(self._lock))
        return entry

    # ---- the worker's step ----
    def ready(self, handoff: str, note: ReadyNote) -> None:
        """P's prompt of ``handoff`` is computed (and sealed) in ``note.blocks``: answer its waiters."""
        with self._lock:
            entry = self._entry(handoff, time.monotonic())
            entry.note, pending, entry.pending = note, entry.pending, []
            entry.token_done = entry.token_done or note.first_token is not None
            entry.cond.notify_all()
        for sender, readers in pending:  # D gave up or was aborted before it knew P's request id
            self.on_note(note.req_id, sender, readers)

    def begin(self, handoff: str, note: ReadyNote) -> None:
        """The forward that completes ``handoff``'s prompt (into ``note.blocks``) starts: its layers follow."""
        with self._lock:
            entry = self._entry(handoff, time.monotonic())
            if entry.note is None and not entry.gone:
                entry.early, entry.layers = note, 0

    def layer(self, handoffs: list[str], region: int) -> None:
        """The model's thread: layer region ``region`` of these hand-offs' prompts is written (cheap: no I/O)."""
        bit = 1 << region
        with self._lock:
            for handoff in handoffs:
                entry = self._entries.get(handoff)
                if entry is not None:
                    entry.layers |= bit
                    if entry.answers():
                        entry.cond.notify_all()

    def gone(self, handoff: str, why: str) -> None:
        """P's request of ``handoff`` ended before its prompt was computed: its waiters are answered at once."""
        with self._lock:
            entry = self._entry(handoff, time.monotonic())
            if entry.note is None:
                entry.gone = why or "P's request ended"
            entry.cond.notify_all()

    def no_token(self, handoff: str) -> None:
        """P's request of ``handoff`` ended otherwise than by length after its prompt: no first token to continue
        after (D's second question is answered at once)."""
        with self._lock:
            entry = self._entry(handoff, time.monotonic())
            entry.token_done = True
            entry.cond.notify_all()

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            for handoff in [h for h, e in self._entries.items() if now - e.since > self.ttl_s]:
                self._entries.pop(handoff).cond.notify_all()  # its waiters look again (a fresh entry)

    # ---- the engine's threads ----
    def wait(self, handoff: str, engine_id: str, wait_s: float) -> dict[str, Any]:
        """D's question: P's blocks of ``handoff`` once announced, else why not (this engine is not the one D
        expects: P restarted; P's request ended first; ``wait_s`` ran out)."""
        if engine_id != self.engine_id:
            return {"ok": False, "why": f"engine {self.engine_id} is not {engine_id} (P restarted?)"}
        end = time.monotonic() + wait_s
        with self._lock:
            entry = self._entry(handoff, time.monotonic())
            while entry.note is None and not entry.gone:
                left = end - time.monotonic()
                if left <= 0:
                    return {"ok": False, "why": f"not ready within {wait_s:g} s"}
                entry.cond.wait(left)
                entry = self._entry(handoff, time.monotonic())  # (expired meanwhile: a fresh one)
            if entry.note is None:
                return {"ok": False, "why": entry.gone}
            return {"ok": True, **entry.note.to_wire()}

    def wait_layers(self, q: LayersQuestion) -> dict[str, Any]:
        """D's layer-wise question: as :meth:`wait`, but answered as soon as the forward that completes the prompt
        has written ``q.need`` layers D lacks (``layers``: the hex mask of those written; ``done``: the forward has
        ended, every layer is final, answered whatever is new)."""
        if q.engine_id != self.engine_id:
            return {"ok": False, "why": f"engine {self.engine_id} is not {q.engine_id} (P restarted?)"}
        end = time.monotonic() + q.wait_s
        wait = (q.have, q.need)
        with self._lock:
            entry = self._entry(q.handoff, time.monotonic())
            while entry.note is None and not entry.gone and (entry.early is None or not entry.enough(q.have, q.need)):
                left = end - time.monotonic()
                if left <= 0:
                    return {"ok": False, "why": f"not ready within {q.wait_s:g} s"}
                entry.waits.append(wait)
                try:
                    entry.cond.wait(left)
                finally:
                    entry.waits.remove(wait)
                entry = self._entry(q.handoff, time.monotonic())
            if entry.note is not None:
                return {"ok": True, **entry.note.to_wire(), "layers": "", "done": True}
            if entry.gone or entry.early is None:
                return {"ok": False, "why": entry.gone}
            return {"ok": True, **entry.early.to_wire(), "layers": f"{entry.layers:x}", "done": False}

    def wait_token(self, handoff: str, engine_id: str, wait_s: float) -> dict[str, Any]:
        """D's second question (it continues after P's first token): ``{"ok": True, "t1": token}`` once P sampled it,
        else why not (another engine, the hand-off gone, no token to continue after, ``wait_s`` ran out)."""
        if engine_id != self.engine_id:
            return {"ok": False, "why": f"engine {self.engine_id} is not {engine_id} (P restarted?)"}
        end = time.monotonic() + wait_s
        with self._lock:
            entry = self._entry(handoff, time.monotonic())
            while not entry.token_done and not entry.gone:
                left = end - time.monotonic()
                if left <= 0:
                    return {"ok": False, "why": f"no first token within {wait_s:g} s"}
                entry.cond.wait(left)
                entry = self._entry(handoff, time.monotonic())
            t1 = entry.note.first_token if entry.note is not None else None
            if t1 is None:
                return {"ok": False, "why": entry.gone or "P's request ended without a first token to continue after"}
            return {"ok": True, "t1": t1}

    def note(self, handoff: str, sender: int, readers: int) -> None:
        """A notification that names the hand-off id (D read nothing): ends P's lease now or once it is known."""
        with self._lock:
            entry = self._entry(handoff, time.monotonic())
            if entry.note is None:
                entry.pending.append((sender, readers))
                return
            req_id = entry.note.req_id
        self.on_note(req_id, sender, readers)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
