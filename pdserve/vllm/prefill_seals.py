"""P, scheduler side: which leased requests' prompt blocks to seal (checksum) at the end of this step's forward.

A lease's checksums used to be computed when P's worker heard of the lease, a step after the forward that completed
the prefill (two with async scheduling). D reads as soon as P answered, so D's notification often came first and
waited for that step: a whole forward of whatever P ran next (seconds for a long prefill on a busy CPU), up to the
seal table's wait, then checksums computed at notification time. A small synchronous read (2 s deadline) could
run out, and D recomputed a prompt it had read intact.

Here the scheduler follows each request that will hand off its KV (``do_remote_decode``, checksums on) through its
prefill chunks, from vLLM's :class:`SchedulerOutput` (new requests' block ids, running requests' new block ids;
a resumed request's replace them), and names in the step that completes the prompt the blocks that hold it; the
worker seals them in ``wait_for_save``, after that forward, before P's answer leaves the engine. D's notification
then finds the checksums waiting. ``request_finished`` settles each seal: kept when the lease covers the same
blocks, forgotten otherwise (not leased: aborted, errored; or other blocks), so the worker's table never keeps a
seal that no lease will end.

No vLLM import: the scheduler output is duck-typed (attributes named where used)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Watched:
    prompt_tokens: int
    fault: str = ""  # its test fault (allow_test_faults), applied by the worker's seal
    blocks: list[int] = field(default_factory=list)


class PrefillSeals:
    """One per engine, in the scheduler: requests followed until their prefill completes, and those sealed."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._watch: dict[str, _Watched] = {}
        self._sealed: dict[str, tuple[int, ...]] = {}  # sealed at a forward's end, until request_finished

    def watch(self, req_id: str, prompt_tokens: int, fault: str = "") -> bool:
        """Follow ``req_id`` (just allocated blocks; again after a preemption) until its prompt is computed.
        True when an earlier seal of it (before a preemption: other blocks, perhaps) is for the worker to forget."""
        if prompt_tokens <= 0:
            return False
        self._watch[req_id] = _Watched(prompt_tokens, fault)
        return self._sealed.pop(req_id, None) is not None

    def step(self, scheduler_output: Any, faults: dict[str, str]) -> dict[str, tuple[int, ...]]:
        """The watched requests whose prompt this step completes -> the blocks that hold it (to seal after the
        forward); their test faults go into ``faults``."""
        if not self._watch:
            return {}
        scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        done: dict[str, tuple[int, ...]] = {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            w = self._watch.get(new.req_id)
            if w is not None:
                w.blocks = list(new.block_ids[0]) if new.block_ids else []
                self._check(new.req_id, w, new.num_computed_tokens + scheduled.get(new.req_id, 0), done, faults)
        cached: Any = getattr(scheduler_output, "scheduled_cached_reqs", None)
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(getattr(cached, "req_ids", ()) or ()):
            w = self._watch.get(req_id)
            if w is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                w.blocks = list(new_ids[0]) if req_id in resumed else w.blocks + list(new_ids[0])
            self._check(req_id, w, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), done, faults)
        return done

    def _check(self, req_id: str, w: _Watched, computed_after: int, done: dict[str, tuple[int, ...]],
               faults: dict[str, str]) -> None:
        if computed_after < w.prompt_tokens:
            return
        n = -(-w.prompt_tokens // self.block_size)
        del self._watch[req_id]
        if len(w.blocks) >= n:
            done[req_id] = self._sealed[req_id] = tuple(w.blocks[:n])
            if w.fault:
                faults[req_id] = w.fault

    def finished(self, req_id: str, leased: tuple[int, ...] | None) -> tuple[bool, bool]:
        """``req_id`` finished, its lease covering ``leased`` (None: not leased): (already sealed with exactly
        those blocks, so no seal is needed; an early seal to forget)."""
        self._watch.pop(req_id, None)
        early = self._sealed.pop(req_id, None)
        if early is None:
            return False, False
        return (True, False) if early == leased else (False, True)

    def __len__(self) -> int:
        return len(self._watch) + len(self._sealed)
