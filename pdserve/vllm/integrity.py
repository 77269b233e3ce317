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

D (:class:`ReadVerifier`): a read of 2 MiB or more is hashed as it lands (:class:`ArrivalHasher`, the transfer
engine's ``on_frame`` hook, on the lane that received each piece, while the peer moves the rest), a smaller one
after it; then the sums are compared with P's reply.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from pdserve.transfer import TransferError
from pdserve.transfer.checksum import MASK64, WSUM, XXH3, XXH3U, sum_u64, to_u64, wsum_rows, xxh3_spans, xxh3_unit
from pdserve.vllm.flips import Flip, placements
from pdserve.vllm.logs import connector_log
from pdserve.vllm.params import LayerGeometry

log = connector_log()


def _is_host(mem: Any) -> bool:
    return isinstance(mem, np.ndarray)


def on_cuda(memory: dict[str, Any]) -> bool:
    """Whether the registered KV cache ``memory`` (layer name -> its bytes) is CUDA memory."""
    devices = [m for m in memory.values() if not _is_host(m)]
    return bool(devices) and devices[0].device.type == "cuda"


class BlockSums:
    """Checksums of whole blocks over ``layers``; ``memory``: layer name -> its registered bytes (a uint8 numpy
    view of host memory, or a flat uint8 torch tensor on a device)."""

    def __init__(self, layers: Sequence[LayerGeometry], memory: dict[str, Any]) -> None:
        self.layers = list(layers)
        self.memory = memory
        self._views: dict[str, memoryview] = {}
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

    def region_sums(self, block_ids: Sequence[int], regions: Sequence[int], alg: str = "") -> list[int]:
        """One checksum per block over only the units of layers ``regions`` (indices into ``layers``), each unit
        seeded with its index in the whole block, so the sums of disjoint region sets add up (mod 2^64) to
        :meth:`sums`: what a layer-wise read verifies per batch of layers (``xxh3u`` and ``wsum32`` only)."""
        alg = alg or self.alg
        want = sorted(set(regions))
        if not block_ids:
            return []
        if alg == WSUM:
            return self._wsums(block_ids, set(want))
        if alg != XXH3U:
            raise ValueError(f"checksum algorithm {alg!r} has no per-layer sums")
        starts = self.unit_starts()
        out = []
        for b in block_ids:
            vals = []
            for i in want:
                g, k = self.layers[i], starts[i]
                view, base = self.view(g.name), b * g.block_stride
                for off, n in g.block_runs:
                    vals.append(xxh3_unit(view[base + off:base + off + n], k))
                    k += 1
            out.append(sum_u64(vals))
        return out

    def unit_starts(self) -> list[int]:
        """Per layer, the index of its first unit in a block (units: every run of every layer, in order)."""
        out, k = [], 0
        for g in self.layers:
            out.append(k)
            k += len(g.block_runs)
        return out

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
        return sum_u64(self._unit_values(block))

    def _unit_values(self, block: int) -> Iterator[int]:
        k = 0
        for g in self.layers:  # memoryview slices: cheaper than numpy views, the same bytes
            view, base = self.view(g.name), block * g.block_stride
            for off, n in g.block_runs:
                yield xxh3_unit(view[base + off:base + off + n], k)
                k += 1

    def view(self, region: str) -> memoryview:
        """A memoryview of host region ``region``'s bytes (made once)."""
        view = self._views.get(region)
        if view is None:
            view = self._views[region] = memoryview(self.memory[region])
        return view

    def units(self, block: int) -> list[tuple[str, int, int]]:
        """The block's units in order: (layer region, byte offset, bytes), one per run of each layer."""
        return [(g.name, block * g.block_stride + off, n) for g in self.layers for off, n in g.block_runs]

    def _wsums(self, block_ids: Sequence[int], only: set[int] | None = None) -> list[int]:
        """One batched reduction per (layer, run) over every block; the runs' sums add up per block. ``only``: the
        layers to sum (the others' words still count toward each word's position weight)."""
        import torch

        total = None
        word = 0
        for i, g in enumerate(self.layers):
            if only is not None and i not in only:
                word += sum(n for _, n in g.block_runs) // 4
                continue
            mem = self.memory[g.name]
            flat = torch.from_numpy(mem) if _is_host(mem) else mem
            idx = torch.tensor(list(block_ids), dtype=torch.int64, device=flat.device)
            for off, n in g.block_runs:
                rows = flat.as_strided(((flat.numel() - off - n) // g.block_stride + 1, n), (g.block_stride, 1), off)
                part = wsum_rows(rows.index_select(0, idx), word)
                total = part if total is None else total + part
                word += n // 4
        if total is None:
            return [0] * len(block_ids)
        return [to_u64(v) for v in total.tolist()]

    def flip_byte(self, block: int, at: int = 0, unit: int = 0, mask: int = 0xFF) -> None:
        """Test faults only: XOR one byte of ``block`` with ``mask``, ``at`` bytes into its unit ``unit`` (default:
        its first layer's first run)."""
        name, off, n = self.units(block)[unit]
        if not 0 <= at < n:
            raise ValueError(f"byte {at} is outside unit {unit} of {n} bytes")
        mem = self.memory[name]
        if _is_host(mem):
            mem[off + at] ^= mask
        else:
            mem[off + at:off + at + 1].bitwise_xor_(mask)


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
    frame (tcp: a piece of it, hashed while still in the cache of the core that received it, as the peer sends
    the rest; same host: each frame the owner copied, as it answers). A unit is hashed once all its bytes are in,
    by whichever lane completed it. :meth:`result`, after the read succeeded, hashes what no frame reported (data
    paths without the hook) and returns one sum per block.

    ``flips`` (test fault, :mod:`pdserve.vllm.flips`): bytes XORed in the units they name as those land, before
    they are hashed (corruption in transit)."""

    alg = XXH3U

    def __init__(self, sums: BlockSums, blocks: Sequence[int], flips: Sequence[Flip] = ()) -> None:
        self.sums, self.blocks = sums, list(blocks)
        self._flips: dict[tuple[int, int], list[Flip]] = {}
        for f in flips:
            self._flips.setdefault((f[0], f[1]), []).append(f)
        self._slot = {b: i for i, b in enumerate(self.blocks)}
        self._top = max(self.blocks, default=-1)
        # region -> (block stride, its runs as (offset, bytes, unit index in the block), its memory)
        self._regions: dict[str, tuple[int, list[tuple[int, int, int]], memoryview]] = {}
        k = 0
        for g in sums.layers:
            runs = [(off, n, k + j) for j, (off, n) in enumerate(g.block_runs)]
            self._regions[g.name] = (g.block_stride, runs, sums.view(g.name))
            k += len(runs)
        self._per_block = k
        self._partial: dict[int, int] = {}  # unit id -> bytes in so far, for units split across frames
        self._done = bytearray(len(self.blocks) * k)  # by unit id: slot * units per block + unit index
        self._left = len(self._done)
        self._acc = [0] * len(self.blocks)
        self._lock = threading.Lock()

    def frame(self, frame: Sequence[Any]) -> None:
        """``frame``'s entries (local region, local offset, ..., length) landed: hash the units they complete."""
        ready: list[_Unit] = []
        with self._lock:
            for e in frame:
                self._arrive(e[0], e[1], e[1] + e[-1], ready)
        self._hash(ready)

    def result(self) -> list[int]:
        with self._lock:
            rest: list[_Unit] = []
            if self._left:  # units never reported by a frame: the read succeeded, so they are in
                for name in self._regions:
                    self._arrive(name, 0, 1 << 62, rest)
        self._hash(rest)
        return [value & MASK64 for value in self._acc]

    def _arrive(self, name: str, lo: int, hi: int, out: list[_Unit]) -> None:
        """Add to ``out`` the units of this read that bytes [lo, hi) of region ``name`` complete."""
        region = self._regions.get(name)
        if region is None:
            return
        stride, runs, view = region
        slot_of, done, per_block, add, before = self._slot.get, self._done, self._per_block, out.append, len(out)
        for off, n, k in runs:  # the unit of block b in this run: [off + b * stride, +n)
            for b in range(max(0, (lo - off - n) // stride + 1), min((hi - off - 1) // stride, self._top) + 1):
                slot = slot_of(b)
                if slot is None or done[uid := slot * per_block + k]:
                    continue
                start = off + b * stride
                if start < lo or start + n > hi:  # the unit is split across frames
                    got = self._partial.pop(uid, 0) + min(hi, start + n) - max(lo, start)
                    if got < n:
                        self._partial[uid] = got
                        continue
                done[uid] = 1
                add((slot, k, start, start + n, view))
        self._left -= len(out) - before

    def _hash(self, units: list[_Unit]) -> None:
        if not units:
            return
        for slot, k, *_ in units if self._flips else ():  # each unit is hashed once: its flips are popped once
            for _, _, at, mask in self._flips.pop((slot, k), ()):
                self.sums.flip_byte(self.blocks[slot], at, k, mask)
                log.warning("pdserve_test_fault=flip: flipped byte %d of unit %d of received block %d as it landed",
                            at, k, self.blocks[slot])
        values = [xxh3_unit(view[lo:hi], k) for _, k, lo, hi, view in units]
        with self._lock:
            acc = self._acc  # summed mod 2**64 in result()
            for unit, value in zip(units, values):
                acc[unit[0]] += value


_Unit = tuple[int, int, int, int, memoryview]  # a landed unit: (slot in the read, unit index, start, end, memory)


STREAM_MIN_BYTES = 2 << 20  # smaller reads are hashed after they land: cheaper at 1 MiB (transfer_bench)


class ReadVerifier:
    """D: checks each read's blocks against P's checksums, hashed as they land where the memory allows (reads of
    ``min_bytes`` or more)."""

    def __init__(self, min_bytes: int = STREAM_MIN_BYTES) -> None:
        self.min_bytes = min_bytes

    def tap(self, sums: BlockSums, blocks: Sequence[int], flips: Sequence[Flip] = ()) -> ArrivalHasher | None:
        """A hasher for a read into ``blocks`` (None where they are hashed after the read: device memory, or a
        read smaller than ``min_bytes``); ``flips``: the test fault's, applied as their units land."""
        nbytes = len(blocks) * sum(g.block_bytes for g in sums.layers)
        if sums.alg != XXH3U or not blocks or nbytes < self.min_bytes:
            return None
        return ArrivalHasher(sums, blocks, flips)

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
        if fault.partition("~")[0] == "late" and blocks:
            for slot, k, at, mask in placements(fault, [n for _, _, n in sums.units(blocks[0])], len(blocks)):
                sums.flip_byte(blocks[slot], at, k, mask)
                log.warning("pdserve_test_fault=%s: wrote into byte %d of unit %d of leased block %d after sealing "
                            "it", fault, at, k, blocks[slot])
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
