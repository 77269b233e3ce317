"""KV integrity: per-block checksums over a worker's registered KV cache, P's table of sealed leases, and D's
comparison.

A block's checksum covers its bytes in every layer of this rank, layer after layer (the worker's registration
order), run after run (:class:`~pdserve.vllm.params.LayerGeometry`): exactly the bytes a P -> D read or a pool
object moves, the same units on both sides (equal layout signatures guarantee the same runs). Host memory is
hashed with ``xxh3u`` (XXH3-64 of each unit, one contiguous run of one layer, seeded with its index in the block,
summed) in place; device memory with the batched ``wsum32`` reduction (:mod:`pdserve.transfer.checksum`). The
producer names its algorithm; the verifier computes that one.

P (:class:`SealTable`): when its worker learns a lease (the step after prefill, the blocks final and held),
it computes the leased blocks' checksums on a worker thread and keeps them until the lease ends. D's READ
batch ends with its notification; P answers it with the sums (the transfer engine's notification reply), so D
gets them in the same round trip as the data. A block written after P sealed it (a late write into a recycled
block, a flipped bit on the link) no longer matches and D recomputes. A notification for a lease P's worker has
not heard of yet (it learns leases a step or two late) is answered with the sums of the blocks D names, computed
then; one for a lease P no longer holds gets no sums, and D recomputes.

D (:class:`ReadVerifier`): the read's frames are hashed as they land (:class:`ArrivalHasher`, the transfer
engine's ``on_frame`` hook, on the lane that received each frame, while the peer moves the next), so when the last
byte is in only the last small frame is left to hash; then the sums are compared with P's reply.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pdserve.transfer import TransferError
from pdserve.transfer.checksum import WSUM, XXH3, XXH3U, add_u64, to_u64, wsum_rows, xxh3_spans, xxh3_unit
from pdserve.vllm.logs import connector_log
from pdserve.vllm.params import LayerGeometry

log = connector_log()


def _is_host(mem: Any) -> bool:
    return isinstance(mem, np.ndarray)


def forward_done_event(memory: dict[str, Any]) -> Any:
    """None for a KV cache in host memory (the forward has written it when ``wait_for_save`` runs); for CUDA
    memory, an event recorded on the current stream, after the forward's kernels, that a seal waits for before
    hashing. (Not run on a GPU yet.)"""
    devices = [m for m in memory.values() if not _is_host(m)]
    if not devices or devices[0].device.type != "cuda":
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


class BlockSums:
    """Checksums of whole blocks over ``layers``; ``memory``: layer name -> its registered bytes (a uint8 numpy
    view of host memory, or a flat uint8 torch tensor on a device)."""

    def __init__(self, layers: Sequence[LayerGeometry], memory: dict[str, Any]) -> None:
        self.layers = list(layers)
        self.memory = memory
        self.alg = XXH3U if all(_is_host(memory[g.name]) for g in self.layers) else WSUM

    def sums(self, block_ids: Sequence[int], alg: str = "") -> list[int]:
        """One unsigned 64-bit checksum per block, by ``alg`` (default: this memory's own)."""
        alg = alg or self.alg
        if not block_ids:
            return []
        if alg == XXH3U:
            return [self._unit_sum(b) for b in block_ids]
        if alg == XXH3:
            return [xxh3_spans(self._host_spans(b)) for b in block_ids]
        if alg == WSUM:
            return self._wsums(block_ids)
        raise ValueError(f"unknown checksum algorithm {alg!r}")

    def _host_spans(self, block: int) -> list[Any]:
        out = []
        for g in self.layers:
            mem = self.memory[g.name]
            base = block * g.block_stride
            for off, n in g.block_runs:
                span = mem[base + off:base + off + n]
                out.append(span if _is_host(mem) else span.cpu().numpy())  # xxh3 of device bytes: via the host
        return out

    def _unit_sum(self, block: int) -> int:
        total = 0
        for k, span in enumerate(self._host_spans(block)):
            total = add_u64(total, xxh3_unit(span, k))
        return total

    def units(self, block: int) -> list[tuple[str, int, int]]:
        """The block's units in order: (layer region, byte offset, bytes), one per run of each layer."""
        return [(g.name, block * g.block_stride + off, n) for g in self.layers for off, n in g.block_runs]

    def _wsums(self, block_ids: Sequence[int]) -> list[int]:
        """One batched reduction per (layer, run) over every block; the runs' sums add up per block."""
        import torch

        total = None
        word = 0
        for g in self.layers:
            mem = self.memory[g.name]
            flat = torch.from_numpy(mem) if _is_host(mem) else mem
            idx = torch.tensor(list(block_ids), dtype=torch.int64, device=flat.device)
            for off, n in g.block_runs:
                rows = flat.as_strided(((flat.numel() - off - n) // g.block_stride + 1, n), (g.block_stride, 1), off)
                part = wsum_rows(rows.index_select(0, idx), word)
                total = part if total is None else total + part
                word += n // 4
        assert total is not None
        return [to_u64(v) for v in total.tolist()]

    def flip_byte(self, block: int, at: int = 0) -> None:
        """Test faults only: flip one byte of ``block`` (its first layer's first run, ``at`` bytes in)."""
        g = self.layers[0]
        off = block * g.block_stride + g.block_runs[0][0] + at
        mem = self.memory[g.name]
        if _is_host(mem):
            mem[off] ^= 0xFF
        else:
            mem[off:off + 1].bitwise_xor_(0xFF)


def mismatched(expected: dict[int, int], local: Sequence[int], remote: Sequence[int], got: Sequence[int]) -> list[int]:
    """D's local blocks whose checksum ``got`` differs from P's ``expected`` for the paired remote block (a remote
    block P did not seal counts as a mismatch)."""
    return [lb for lb, rb, g in zip(local, remote, got) if expected.get(rb) != g]


def check_read(sums: BlockSums, fingerprint: int, reply: Any, local: Sequence[int],
               remote: Sequence[int], arrived: ArrivalHasher | None = None) -> tuple[str, int]:
    """D: (why the blocks just read into ``local`` must not be used, "" when they may; how many matched), from P's
    ``reply`` to the read's notification (:meth:`SealTable.reply`). ``arrived``: the sums hashed as the read
    landed (used when P's algorithm is theirs; otherwise the blocks are hashed now)."""
    got_arrived = arrived.result() if arrived is not None else None  # also applies its flip fault, before any hash
    if not isinstance(reply, dict):
        return "P answered no checksums (its kv_checksum is off, or an older pdserve)", 0
    if reply.get("fp") != fingerprint:
        return f"P's fingerprint digest {reply.get('fp')} is not ours ({fingerprint})", 0
    if "missing" in reply:
        return f"P has no checksums: {reply['missing']}", 0
    expected = dict(zip(reply.get("b") or [], reply.get("c") or []))
    alg = str(reply.get("alg") or "")
    got = got_arrived if arrived is not None and got_arrived is not None and alg == arrived.alg else \
        sums.sums(local, alg)
    bad = mismatched(expected, local, remote, got)
    if bad:
        why = f"{len(bad)} of {len(got)} blocks differ from P's checksums (D blocks {list(bad[:8])})"
        return why, len(got) - len(bad)
    return "", len(got)


class ArrivalHasher:
    """D: the ``xxh3u`` sums of one read's blocks (D's ``blocks``), hashed unit by unit while the read's frames
    land. :meth:`frame` is the transfer engine's ``on_frame`` hook: it runs on the transfer lane that received the
    frame, so the lane hashes frame i while the peer copies or sends frame i+1 (the lane asked for all its frames at
    once); a unit is hashed once all its bytes are in, by whichever lane completed it (python-xxhash releases the
    GIL, so lanes hash in parallel). :meth:`result`, after the read succeeded, hashes what no frame reported (data
    paths without the hook) and returns one sum per block.

    ``flip`` (test fault): the first block's first unit gets a byte flipped as it lands, before it is hashed
    (corruption in transit)."""

    alg = XXH3U

    def __init__(self, sums: BlockSums, blocks: Sequence[int], flip: bool = False) -> None:
        self.sums, self.blocks, self.flip = sums, list(blocks), flip
        self._slot = {b: i for i, b in enumerate(self.blocks)}
        self._layers: dict[str, tuple[LayerGeometry, int]] = {}  # region -> (geometry, index of its first unit)
        k = 0
        for g in sums.layers:
            self._layers[g.name] = (g, k)
            k += len(g.block_runs)
        self._partial: dict[tuple[int, int], int] = {}  # (slot, unit index) -> bytes in so far
        self._done: set[tuple[int, int]] = set()
        self._acc = [0] * len(self.blocks)
        self._lock = threading.Lock()

    def frame(self, frame: Sequence[Any]) -> None:
        """``frame``'s entries (local region, local offset, ..., length) landed: hash the units they complete."""
        ready = []
        with self._lock:
            for e in frame:
                ready += self._arrive(e[0], e[1], e[1] + e[-1])
        self._hash(ready)

    def result(self) -> list[int]:
        with self._lock:
            if len(self._done) == len(self.blocks) * sum(len(g.block_runs) for g, _ in self._layers.values()):
                return list(self._acc)  # every unit landed through a frame (the usual case)
            rest = [(slot, k, name, b * g.block_stride + off, n) for slot, b in enumerate(self.blocks)
                    for name, (g, k0) in self._layers.items() for k, (off, n) in enumerate(g.block_runs, k0)
                    if (slot, k) not in self._done]  # never reported by a frame: the read succeeded, so they are in
            self._done.update((slot, k) for slot, k, *_ in rest)
        self._hash(rest)
        return list(self._acc)

    def _arrive(self, name: str, lo: int, hi: int) -> list[tuple[int, int, str, int, int]]:
        """The units that bytes [lo, hi) of region ``name`` complete: (slot, unit index, region, offset, bytes)."""
        layer = self._layers.get(name)
        if layer is None:
            return []
        g, k0 = layer
        out: list[tuple[int, int, str, int, int]] = []
        pos = lo
        while pos < hi:
            at = self._unit_at(g, pos)
            if at is None:
                return out  # not a unit of this read (cannot happen for the connector's entries)
            j, block, within = at
            n = g.block_runs[j][1]
            take = min(hi - pos, n - within)
            key = (self._slot[block], k0 + j)
            got = self._partial.pop(key, 0) + take
            if got < n:
                self._partial[key] = got
            elif key not in self._done:
                self._done.add(key)
                out.append((*key, name, pos - within, n))
            pos += take
        return out

    def _unit_at(self, g: LayerGeometry, pos: int) -> tuple[int, int, int] | None:
        """(run, block, bytes into the run) of the unit of this read holding byte ``pos`` of ``g``'s region."""
        for j, (off, n) in enumerate(g.block_runs):
            block, within = divmod(pos - off, g.block_stride)
            if pos >= off and within < n and block in self._slot:
                return j, block, within
        return None

    def _hash(self, units: list[tuple[int, int, str, int, int]]) -> None:
        for slot, k, name, off, n in units:
            if self.flip and slot == 0 and k == 0:
                self.sums.flip_byte(self.blocks[0])
                log.warning("pdserve_test_fault=flip: flipped a byte of received block %d as it landed",
                            self.blocks[0])
            value = xxh3_unit(self.sums.memory[name][off:off + n], k)
            with self._lock:
                self._acc[slot] = add_u64(self._acc[slot], value)


STREAM_MIN_BYTES = 2 << 20  # smaller reads are hashed after they land: tapered frames cost more than they hide


class ReadVerifier:
    """D: checks each read's blocks against P's checksums, hashed as they land where the memory allows (reads of
    ``min_bytes`` or more)."""

    def __init__(self, min_bytes: int = STREAM_MIN_BYTES) -> None:
        self.min_bytes = min_bytes

    def tap(self, sums: BlockSums, blocks: Sequence[int], flip: bool = False) -> ArrivalHasher | None:
        """A hasher for a read into ``blocks`` (None where they are hashed after the read: device memory, or a
        read smaller than ``min_bytes``)."""
        nbytes = len(blocks) * sum(g.block_bytes for g in sums.layers)
        if sums.alg != XXH3U or not blocks or nbytes < self.min_bytes:
            return None
        return ArrivalHasher(sums, blocks, flip)

    @staticmethod
    def verify(sums: BlockSums, fingerprint: int, reply: Any, local: Sequence[int], remote: Sequence[int],
               arrived: ArrivalHasher | None, where: str, stats: dict[str, Any]) -> None:
        """Raise TransferError("checksum") unless the blocks read into ``local`` match P's ``reply`` (so vLLM
        recomputes them); counts the matched blocks in ``stats["verified"]``."""
        problem, stats["verified"] = check_read(sums, fingerprint, reply, local, remote, arrived)
        stats["streamed"] = arrived is not None
        if problem:
            stats["checksum_failed"] = True
            log.error("%s: KV checksum failure: %s; vLLM will recompute", where, problem)
            raise TransferError("checksum", problem)


def sealer(sums: BlockSums, fault: str = "", ready: Any = None) -> Callable[[Sequence[int]], list[int]]:
    """P: what computes a lease's checksums over ``sums``' memory: first waits for ``ready`` (a CUDA event: the
    forward that wrote the blocks); with test fault ``late`` (the caller allows test faults) then writes into the
    first block, as a late writer would."""
    def seal(blocks: Sequence[int]) -> list[int]:
        if ready is not None:
            import torch

            torch.cuda.current_stream().wait_event(ready)
        out = sums.sums(blocks)
        if fault == "late" and blocks:
            sums.flip_byte(blocks[0])
            log.warning("pdserve_test_fault=late: wrote into leased block %d after sealing it", blocks[0])
        return out
    return seal


class SealTable:
    """P: checksums of each leased request's blocks, computed off the model's thread, answered to D's notification.

    P's worker learns a lease from the step after the one that finished the prefill (with vLLM's async scheduling,
    the one after that), so D's notification may come first, by a whole step (seconds, for a long prefill on a busy
    P). :meth:`reply` waits for the lease up to ``wait_s``; then, if D named the blocks it read, it checksums those
    blocks now (``compute``): they are still P's, since a lease ends only after the worker has heard of it, and a
    flip in transit or a write after the read still shows. (With only the 1 s wait, D recomputed 15 of 16
    1,024-token prompts in a 1P1D bench.) A lease that already ended is answered at once.

    Thread-safe: ``seal`` and ``drop`` run on the worker's step, ``reply`` on the transfer engine's thread."""

    ENDED_KEPT = 4096  # how many ended leases are remembered (answered at once instead of waited for)

    def __init__(self, wait_s: float = 1.0, threads: int = 2) -> None:
        self.wait_s = wait_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pdserve-seal")
        self._sealed: dict[str, tuple[tuple[int, ...], Future]] = {}
        self._ended: dict[str, None] = {}  # insertion-ordered: the oldest is forgotten first
        self._cond = threading.Condition()

    def seal(self, req_id: str, block_ids: Sequence[int], compute: Callable[[Sequence[int]], list[int]]) -> None:
        """Start computing the checksums of ``block_ids`` for ``req_id`` (once per request)."""
        with self._cond:
            if req_id in self._sealed:
                return
            blocks = tuple(block_ids)
            self._sealed[req_id] = (blocks, self._pool.submit(compute, blocks))
            self._cond.notify_all()

    def reply(self, req_id: str, alg: str, fingerprint: int, read: Sequence[int] = (),
              compute: Callable[[Sequence[int]], list[int]] | None = None) -> dict[str, Any]:
        """What D's notification for ``req_id`` gets back: ``{"alg", "fp", "b": block ids, "c": sums}``, or
        ``{"fp", "missing": why}`` when the request is not (or no longer) sealed here. Waits up to ``wait_s`` for a
        lease this worker has not heard of yet (D may read as soon as P's scheduler answered), then checksums the
        blocks D ``read`` with ``compute`` (class doc)."""
        with self._cond:
            self._cond.wait_for(lambda: req_id in self._sealed or req_id in self._ended, self.wait_s)
            entry = self._sealed.get(req_id)
            ended = req_id in self._ended
        if entry is None and not ended and read and compute is not None:
            try:
                return {"alg": alg, "fp": fingerprint, "b": list(read), "c": compute(read), "unsealed": True}
            except Exception as exc:  # e.g. a block id this cache does not have
                return {"fp": fingerprint, "missing": f"checksum of the blocks read failed: {exc}"}
        if entry is None:
            why = "the lease ended" if ended else f"no lease heard of within {self.wait_s:g} s"
            return {"fp": fingerprint, "missing": why}
        blocks, future = entry
        try:
            sums = future.result(timeout=max(self.wait_s, 5.0))
        except Exception as exc:
            return {"fp": fingerprint, "missing": f"checksum failed: {type(exc).__name__}: {exc}"}
        return {"alg": alg, "fp": fingerprint, "b": list(blocks), "c": sums}

    def drop(self, req_ids: Sequence[str]) -> None:
        """The leases ended: forget their checksums (and answer a late notification for them at once)."""
        with self._cond:
            for req_id in req_ids:
                self._sealed.pop(req_id, None)
                self._ended[req_id] = None
            while len(self._ended) > self.ENDED_KEPT:
                del self._ended[next(iter(self._ended))]
            self._cond.notify_all()

    def forget(self, req_ids: Sequence[str]) -> None:
        """Seals no lease stands for (made at a prefill's last forward; the request was not leased, or other
        blocks were): dropped, not answered as ended (a lease of the same id may still come)."""
        with self._cond:
            for req_id in req_ids:
                self._sealed.pop(req_id, None)

    def __len__(self) -> int:
        with self._cond:
            return len(self._sealed)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
