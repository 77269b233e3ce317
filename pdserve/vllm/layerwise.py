"""Layer-wise KV of an early hand-off (issue 37; docs/architecture.md, section 3, "Layer by layer").

P (:class:`LayerMarks`): the worker learns, before the forward that completes an early hand-off's prompt, which
hand-offs that forward completes (``PdserveMeta.ready``); vLLM calls ``save_kv_layer`` after each attention layer
has written its KV, and the layer's region is marked ready on the :class:`~pdserve.vllm.handoff_board.HandoffBoard`
(a bit under its lock: the forward never waits for the wire). Layers that share one registered region (cross-layer
KV sharing) count once all of them are saved. Earlier chunks of a chunked prefill are not announced on their own:
layer ``i`` is announced, for every block of the prompt, when the last chunk's forward has written it.

D (:class:`LayerPull`): asks P's rank for layers it lacks, reads each batch P announces into its own blocks (only
the blocks it lacks: a prefix hit is not read), verifies the batch against P's per-layer checksums before asking
for more, and returns once every layer landed; the worker then notifies P (which ends the lease) and reports the
load, so D's first step starts when the last layer is in. A read that reshards heads (P's TP unlike D's) keeps the
whole-request path.

No vLLM import.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.transfer import TransferError
from pdserve.vllm.flips import Flip
from pdserve.vllm.handoff_board import layers_message
from pdserve.vllm.integrity import BlockSums
from pdserve.vllm.logs import connector_log
from pdserve.vllm.messages import ReadyNote, RecvJob
from pdserve.vllm.params import LayerGeometry, build_entries

log = connector_log()


class LayerMarks:
    """P, one per worker rank: which registered region each layer name belongs to, and the layers the running
    forward has saved for the hand-offs it completes."""

    def __init__(self) -> None:
        self.region_of: dict[str, int] = {}
        self.members: list[int] = []
        self.live: list[str] = []
        self._saved: list[int] = []

    def add(self, name: str, region: int) -> None:
        """Layer ``name`` is registered in region ``region`` (a new region when it is the next index)."""
        self.region_of[name] = region
        if region == len(self.members):
            self.members.append(1)
        else:
            self.members[region] += 1

    def begin(self, handoffs: Sequence[str]) -> None:
        """A forward starts that completes these hand-offs' prompts."""
        self.live = list(handoffs)
        self._saved = [0] * len(self.members) if handoffs else []

    def saved(self, name: str) -> int | None:
        """The model's thread saved layer ``name``: its region when that completes the region for the live
        hand-offs, else None (nothing live, an unknown layer, or other layers of the region still to come)."""
        if not self.live:
            return None
        region = self.region_of.get(name)
        if region is None:
            return None
        self._saved[region] += 1
        return region if self._saved[region] == self.members[region] else None

    def end(self) -> None:
        self.live, self._saved = [], []


@dataclass
class PullResult:
    """What a layer-wise read did: the job with P's blocks, bytes moved, batches, layers confirmed to have landed
    before P's forward ended, and each batch's wall-clock [start, end]."""

    job: RecvJob
    nbytes: int = 0
    batches: int = 0
    layers_early: int = 0
    spans: list[list[float]] = field(default_factory=list)
    entries: list[tuple[str, int, str, int, int]] = field(default_factory=list)


class LayerPull:
    """D, one early hand-off read from P's rank of our TP rank (same TP, same layout): see the module docstring."""

    def __init__(self, engine: Any, peer: Any, engine_id: str, layers: Sequence[LayerGeometry], sums: BlockSums,
                 fp_digest: int, verify: bool, peer_blocks: int,
                 pair: Callable[[RecvJob, ReadyNote], RecvJob], min_batch_bytes: int = 0) -> None:
        self.engine, self.peer, self.engine_id = engine, peer, engine_id
        self.layers, self.sums, self.fp_digest, self.verify = list(layers), sums, fp_digest, verify
        self.peer_blocks, self.pair, self.min_batch_bytes = peer_blocks, pair, min_batch_bytes
        self.starts = sums.unit_starts()

    def need(self, blocks: int, have: int) -> int:
        """How many new layers to ask P for at once: enough that a batch of ``blocks`` blocks carries
        ``min_batch_bytes`` (a short prompt's small layers move in fewer batches, each with its fixed cost and
        P's answer), at least 1, at most the layers still missing."""
        missing = len(self.layers) - bin(have).count("1")
        if missing <= 0:  # (no layers at all included)
            return 1
        per_layer = blocks * sum(g.block_bytes for g in self.layers) / len(self.layers)
        want = -(-self.min_batch_bytes // max(1, int(per_layer))) if per_layer else missing
        return max(1, min(missing, want))

    def run(self, job: RecvJob, wait_s: float, batch_deadline: Callable[[RecvJob], float],
            flips_for: Callable[[RecvJob], list[Flip]], margin_s: float = 1.0) -> PullResult:
        """Read every layer of ``job``'s blocks as P announces it; raises TransferError on a refusal, a timeout,
        a failed batch or a checksum mismatch (the caller reports the load failed: vLLM recomputes)."""
        full = (1 << len(self.layers)) - 1
        have, end_at = 0, time.monotonic() + wait_s
        first, end = job.first_block, job.first_block + len(job.plan.local)
        out: PullResult | None = None
        flips: list[Flip] = []
        last = 0  # layers of the previous batch, confirmed early if P's next answer says its forward goes on
        while have != full:
            left = end_at - time.monotonic()
            if left <= 0:
                raise TransferError("handoff", f"P announced {bin(have).count('1')} of {len(self.layers)} "
                                               f"layers of {job.remote.handoff} within {wait_s:g} s")
            reply = self._ask(job.remote.handoff, left, have, first, end, margin_s, self.need(end - first, have))
            note = self._note(reply)
            if out is None:
                out = PullResult(self.pair(job, note))
                flips = flips_for(out.job)
            elif note.req_id != out.job.remote.request_id:
                raise TransferError("handoff", f"P answered request {note.req_id}, before {out.job.remote.request_id}")
            if not reply.get("done"):
                out.layers_early += last
            ready = full if reply.get("done") else int(str(reply.get("layers") or "0"), 16) & full
            new = [i for i in range(len(self.layers)) if (ready & ~have) >> i & 1]
            if not new:
                continue
            self._batch(out, new, reply, batch_deadline(out.job), flips)
            have |= sum(1 << i for i in new)
            last = len(new)
        assert out is not None or not self.layers
        return out if out is not None else PullResult(job)

    def _ask(self, handoff: str, left: float, have: int, first: int, end: int, margin_s: float,
             need: int = 1) -> dict[str, Any]:
        handle = self.engine.submit(self.peer, [], "read",
                                    notify=layers_message(handoff, self.engine_id, left, have, first, end, need),
                                    deadline_s=left + margin_s)
        handle.result()
        reply = handle.reply if isinstance(handle.reply, dict) else {}
        if not reply.get("ok"):
            raise TransferError("handoff", f"P has no KV for hand-off {handoff}: {reply.get('why') or 'no answer'}")
        return reply

    @staticmethod
    def _note(reply: dict[str, Any]) -> ReadyNote:
        try:
            return ReadyNote.from_wire(reply)
        except ValueError as exc:
            raise TransferError("handoff", str(exc)) from None

    def _batch(self, out: PullResult, regions: list[int], reply: dict[str, Any], deadline_s: float,
               flips: Sequence[Flip]) -> None:
        """Read ``regions`` of the job's blocks in one transfer batch, apply test flips to them, verify them."""
        if deadline_s <= 0:
            raise TransferError("deadline", "P's lease on the blocks ran out before the read")
        entries = build_entries([self.layers[i] for i in regions], out.job.plan, self.peer_blocks)
        t0 = time.time()
        handle = self.engine.submit(self.peer, entries, "read", deadline_s=deadline_s)
        handle.result()
        out.spans.append([t0, time.time()])
        out.nbytes += handle.total_bytes
        out.batches += 1
        out.entries += entries
        local = out.job.plan.local
        for slot, k, at, mask in flips:
            if any(self.starts[i] <= k < self.starts[i] + len(self.layers[i].block_runs) for i in regions):
                self.sums.flip_byte(local[slot], at, k, mask)
                log.warning("request %s: test fault: flipped byte %d of unit %d of received block %d",
                            out.job.req_id, at, k, local[slot])
        if self.verify:
            self._check(out.job, regions, reply)

    def _check(self, job: RecvJob, regions: list[int], reply: dict[str, Any]) -> None:
        """Raise TransferError("checksum") unless ``regions`` of D's blocks equal P's per-layer sums."""
        if reply.get("fpd") != self.fp_digest:
            raise TransferError("checksum", f"P's fingerprint digest {reply.get('fpd')} is not ours "
                                            f"({self.fp_digest})")
        sums = reply.get("sums") or {}
        mask = sum(1 << i for i in regions)
        expected = sums.get(f"{mask:x}") if isinstance(sums, dict) else None
        if not isinstance(expected, list):
            raise TransferError("checksum", f"P answered no checksums for layers {regions}")
        got = self.sums.region_sums(job.plan.local, regions, str(reply.get("alg") or ""))
        bad = [b for b, g, e in zip(job.plan.local, got, expected) if g != e]
        if bad or len(expected) != len(got):
            raise TransferError("checksum", f"{len(bad)} of {len(got)} blocks differ from P's checksums of layers "
                                            f"{regions} (D blocks {bad[:8]})")
