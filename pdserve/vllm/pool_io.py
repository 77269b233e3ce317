"""One KV pool job of the worker: save a request's blocks to the pool with their seals, or load pooled blocks and
keep only those whose seal is this worker's fingerprint and whose checksum matches what arrived
(:mod:`pdserve.vllm.pool` describes the object and its seal)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pdserve.store import StoreClient, StoreError
from pdserve.vllm.integrity import BlockSums
from pdserve.vllm.logs import connector_log
from pdserve.vllm.messages import PoolJob
from pdserve.vllm.params import LayerGeometry
from pdserve.vllm.pool import SealSlots, loaded_prefix, pool_items, seal_problem

log = connector_log()


class PoolIO:
    """Runs pool jobs against ``pool`` for the blocks of ``layers`` (whose bytes ``sums`` reads)."""

    def __init__(self, pool: StoreClient, layers: Sequence[LayerGeometry], sums: BlockSums, slots: SealSlots,
                 fingerprint: int, checksum: bool, block_bytes: int) -> None:
        self.pool, self.layers, self.sums, self.slots = pool, list(layers), sums, slots
        self.fingerprint, self.checksum, self.block_bytes = fingerprint, checksum, block_bytes

    @staticmethod
    def run_job(io: PoolIO | None, job: PoolJob) -> tuple[int, dict[str, Any]]:
        """Run ``job`` on ``io`` (None: no pool here); (blocks that made it, stats with ``ms`` (the whole job),
        ``io_s`` (the store's put or get call alone: master RPCs and the bytes' transfer, not the seals, as
        Mooncake Store's connector times its own), ``error`` on a failure). Never raises: the pool is a cache, a
        failure costs a recompute, never a wrong token."""
        t0 = time.perf_counter()
        good = 0
        stats: dict[str, Any] = {"blocks": len(job.keys), "bytes": 0}
        try:
            if io is None or job.error:
                raise StoreError("plan", job.error or "no pool configured on this worker")
            good, stats = io.run(job)
        except Exception as exc:
            stats["error"] = f"{type(exc).__name__}: {exc}"
            log.warning("request %s: KV pool %s failed: %s", job.req_id, "save" if job.save else "load",
                        stats["error"])
        stats["ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        if not job.save and good:
            log.info("request %s: loaded %d of %d blocks (%d B) from the KV pool in %.2f ms", job.req_id, good,
                     len(job.block_ids), stats["bytes"], stats["ms"])
        return good, stats

    def run(self, job: PoolJob) -> tuple[int, dict[str, Any]]:
        """(blocks that made it, stats); raises StoreError when the job could not run at all."""
        taken = self.slots.take(len(job.keys))
        if job.keys and not taken:
            raise StoreError("seal", f"no free seal slots for {len(job.keys)} blocks")
        try:
            items = pool_items(self.layers, job.keys, job.block_ids, taken)
            return self._save(job, items, taken) if job.save else self._load(job, items, taken)
        finally:
            self.slots.give(taken)

    def _save(self, job: PoolJob, items: list, slots: list[int]) -> tuple[int, dict[str, Any]]:
        sums = self.sums.sums(job.block_ids) if self.checksum else [0] * len(slots)
        for slot, value in zip(slots, sums):
            self.slots.write(slot, self.sums.alg if self.checksum else "", self.fingerprint, value)
        t0 = time.perf_counter()
        statuses = self.pool.put(items)
        stored = statuses.count("stored")
        return stored + statuses.count("exists"), {
            "blocks": len(job.keys), "stored": stored, "bytes": stored * self.block_bytes,
            "full": statuses.count("full"), "failed": statuses.count("failed"), "io_s": time.perf_counter() - t0}

    def _load(self, job: PoolJob, items: list, slots: list[int]) -> tuple[int, dict[str, Any]]:
        t0 = time.perf_counter()
        good = loaded_prefix(self.pool.get_into(items))
        stats: dict[str, Any] = {"blocks": len(job.keys), "bytes": 0, "io_s": time.perf_counter() - t0}
        checked, corrupt = self.verified(job, slots, good)
        if checked < good:
            stats["seal_failures"] = 1
        if corrupt is not None:  # our fingerprint, wrong bytes: nobody can use it; another model's block stays
            try:
                self.pool.remove([corrupt])
            except StoreError as exc:
                log.warning("could not remove corrupt KV pool object %016x: %s", corrupt, exc)
        stats["bytes"] = checked * self.block_bytes
        return checked, stats

    def verified(self, job: PoolJob, slots: Sequence[int], good: int) -> tuple[int, int | None]:
        """How many of the first ``good`` loaded blocks may be used (up to the first whose seal is wrong), and the
        key of that block when its bytes are corrupt (our fingerprint, another checksum)."""
        seals = [self.slots.read(s) for s in slots[:good]]
        sums: list[int | None] = [None] * good
        if self.checksum and good:
            algs = {s[0] for s in seals if s is not None and s[0]}
            alg = algs.pop() if len(algs) == 1 else self.sums.alg
            sums = list(self.sums.sums(job.block_ids[:good], alg))
        for i, (seal, value) in enumerate(zip(seals, sums)):
            problem = seal_problem(seal, self.fingerprint, value)
            if problem:
                log.error("request %s: KV pool block %d (key %016x, into block %d) rejected: %s; recomputing it "
                          "and the %d after it", job.req_id, i, job.keys[i], job.block_ids[i], problem, good - i - 1)
                return i, job.keys[i] if problem.startswith("checksum") else None
        return good, None
