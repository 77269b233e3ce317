"""The connector's worker half: registers the KV cache with the transfer engine, runs the scheduler's
plans (D's reads from P, KV pool loads and saves) off the model's thread, and reports their results.

P's held blocks are the :class:`~pdserve.vllm.release.ReleaseLedger`'s: this module feeds it the leases and
pool saves from :class:`PdserveMeta`, D's READ notifications from the transfer engine and the ended saves,
and reports what it releases as ``finished_sending``.

D's read: one transfer batch, one entry per layer per block, with notify=remote_request_id (which ends P's
lease and is answered with P's checksums, checked before the load is reported: :mod:`pdserve.vllm.integrity`),
then ``finished_recving`` (or also ``failed_recving`` + the block ids: vLLM recomputes the prompt).
A synchronous read (``RecvJob.sync``: vLLM scheduled the request in this step) runs inside ``start_load_kv``,
before the step's forward, within ``sync_load_deadline_s``; it is reported in neither set (the request is
running), a failed one only by its block ids (vLLM recomputes from the first invalid block and drops the
token the step sampled).

Tensor parallelism: every rank is one WorkerSide with its own engine and KV shard. With P's TP equal to D's,
D's rank r reads whole blocks from P's rank r; otherwise it reads its heads' slices from the P ranks holding
them, one batch per P rank (:mod:`pdserve.vllm.shards`). vLLM reports a request loaded (or failed) once every
rank has.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from pdserve.settings.speculative import drafts_with_layers
from pdserve.store import ClientConfig, StoreClient
from pdserve.transfer import TransferConfig, TransferEngine, TransferError
from pdserve.transfer.checksum import XXH3U
from pdserve.vllm.fence import DeviceFence, record_event
from pdserve.vllm.fingerprint import differences, digest, worker_fingerprint
from pdserve.vllm.flips import Flip, placements
from pdserve.vllm.groups import MAMBA, GroupSpec, groups_of, hybrid_tag, is_hybrid
from pdserve.vllm.handoff_board import TOKEN_PREFIX, HandoffBoard, is_handoff, parse_layers, parse_wait, wait_message
from pdserve.vllm.head_sums import head_reply, verify_slices
from pdserve.vllm.integrity import BlockSums, ReadVerifier, SealTable, on_cuda, sealer
from pdserve.vllm.kvmemory import byte_region, zero_ranges
from pdserve.vllm.layerwise import LayerMarks, LayerPull
from pdserve.vllm.layout import KVLayout, LayoutError, attn_backend, derive_layout, layout_of_tensor
from pdserve.vllm.logs import connector_log
from pdserve.vllm.messages import (
    LEASE,
    NOTIFIED,
    PdserveHandshake,
    PdserveMeta,
    PdserveWorkerMeta,
    PoolJob,
    ReadyNote,
    RecvJob,
)
from pdserve.vllm.metrics import PdserveStats
from pdserve.vllm.params import (
    PEER_BLOCKS_SEP,
    BlockPlan,
    ConnectorConfig,
    LayerGeometry,
    RemoteParams,
    build_entries,
    fault_hits,
    layout_blocks,
    layout_signature,
    same_layout,
    with_blocks,
)
from pdserve.vllm.pool import SEAL_REGION, SealSlots, loaded_tokens
from pdserve.vllm.pool_io import PoolIO
from pdserve.vllm.read_signal import READ_SIGNAL
from pdserve.vllm.regions import join
from pdserve.vllm.release import Released, ReleaseLedger
from pdserve.vllm.shards import (
    RankLayer,
    ShardError,
    notifiers,
    notify_message,
    parse_notify,
    plan_slices,
    rank_heads,
    release_notifiers,
    slice_entries,
    split_heads,
    to_notify,
    unit_signature,
)
from pdserve.vllm.spans import kv_span

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = connector_log()


def _transfer_groups(kv_cache_config: Any) -> tuple[Any, ...]:
    groups = getattr(kv_cache_config, "transfer_groups", None)
    return tuple(groups if groups is not None else getattr(kv_cache_config, "kv_cache_groups", None) or ())


class WorkerSide:
    """One per vLLM worker process: owns the transfer engine, the registered KV cache and the held blocks."""

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig, kv_cache_config: Any = None) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        # KV cache groups (vLLM's hybrid KV cache manager) and each layer's
        self.groups = groups_of(kv_cache_config, self.block_size) if kv_cache_config is not None else ()
        self.hybrid = is_hybrid(self.groups)
        self.layer_groups: dict[str, GroupSpec] = {}
        for spec, group in zip(self.groups, _transfer_groups(kv_cache_config)):
            self.layer_groups.update({layer: spec for layer in group.layer_names})
        rank = 0
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            rank = get_tensor_model_parallel_rank()
        except Exception:
            pass
        self.rank = rank
        self.tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        # data-parallel attention: each DP rank of a worker is an engine of its own; a fixed transfer port is
        # offset past the TP ranks of the DP ranks before it (the chart opens TP x DP ports)
        dp_local = int(getattr(vllm_config.parallel_config, "data_parallel_rank_local", 0) or 0)
        try:
            # MLA caches one latent per token, which every TP rank holds whole: one KV head, replicated (vLLM's
            # get_total_num_kv_heads answers the config's num_key_value_heads, its per-rank count 1)
            model = vllm_config.model_config
            self.kv_heads = 1 if getattr(model, "use_mla", False) else int(model.get_total_num_kv_heads())
        except Exception:
            self.kv_heads = 0  # unknown: only the same TP degree on P and D can hand off
        self.rank_layers: list[RankLayer] = []
        self.unit = ""
        port = config.port_for_rank(dp_local * self.tp + rank)
        tconf = TransferConfig(secret=config.secret, host=config.transfer_host,
                               advertise_host=config.advertise_host, port=port,
                               backend=config.backend, streams=config.streams,
                               default_deadline_s=config.transfer_deadline_s)
        self.engine = TransferEngine(tconf)
        self.layers: list[LayerGeometry] = []
        self.layout = ""
        self.kv_layouts: dict[str, KVLayout] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._memory: dict[str, Any] = {}  # layer -> its registered bytes (pdserve.vllm.kvmemory.byte_region)
        self.sums = BlockSums([], {})
        self.fingerprint: dict[str, str] = {}
        self.fp_digest = 0
        self._seals = SealTable()  # P: checksums of leased blocks, answered to D's notification
        self.verifier = ReadVerifier()  # D: hashes what a read lands, checks it against P's answer
        self._pool_io: PoolIO | None = None
        self._peers: dict[tuple[str, int], Any] = {}
        self._ledger = ReleaseLedger(early_ttl_s=max(600.0, 4 * config.lease_s))
        self._lease_spans: dict[str, tuple[str, float]] = {}  # traced leases: P request id -> (traceparent, start)
        # P: early hand-offs' rendezvous; a notification naming a hand-off id counts toward its lease once known
        self._board = HandoffBoard(self.engine.engine_id, lambda req_id, sender, readers: self._ledger.notify(
            req_id, sender=sender, readers=readers), ttl_s=max(600.0, 4 * config.lease_s))
        self.engine.on_notify(self._on_notify)
        # P, layer-wise (issue 37): the layers the running forward has saved for the hand-offs it completes
        self._marks = LayerMarks()
        self._fence = DeviceFence()  # the board hears of bytes on a device once its kernels ran (pdserve.vllm.fence)
        self._cuda = False  # the KV cache is CUDA memory (set at registration)
        self._by_layer = False  # P announces, and D reads, an early hand-off layer by layer (set at registration)
        self._marks_meta: PdserveMeta | None = None  # the step whose forward the marks are of
        self._lock = threading.Lock()
        self._inflight: dict[str, RecvJob] = {}
        self._done: list[tuple[RecvJob, bool, dict[str, Any]]] = []
        self._invalid: set[int] = set()
        self._meta = PdserveWorkerMeta()
        self.stats = PdserveStats()  # since the last get_kv_connector_stats
        self.pool: StoreClient | None = None
        if config.pool_address is not None:
            host, port = config.pool_address
            self.pool = StoreClient(ClientConfig(host, port, secret=config.secret,
                                                 timeout_s=max(config.pool_timeout_s, 2.0),
                                                 transfer_deadline_s=min(config.transfer_deadline_s, 4.0)),
                                    self.engine)
        self._pool_done: list[tuple[PoolJob, int, dict[str, Any]]] = []  # (job, blocks that made it, stats)
        READ_SIGNAL.attach()  # D's scheduler in this process sleeps until a read ends (pdserve.vllm.read_signal)
        seg = self.engine.segment()
        log.info("worker rank %d: transfer engine %s listening on %s:%d (backend %s)", rank,
                 self.engine.engine_id, seg.host, seg.port, config.backend)

    # ---- start-up ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        seen: dict[int, int] = {}  # tensor address -> index of its region in self.layers
        dtype = ""
        for name in sorted(kv_caches):
            t = kv_caches[name]
            kv = self._layout(name, t)
            spec = self.layer_groups.get(name)
            ratio = 1 if spec is not None and spec.kind == MAMBA else max(
                1, (spec.block_size if spec is not None else self.block_size) // kv.block_tokens)
            stride, runs, scales = kv.manager_runs(ratio)
            geo = LayerGeometry(name, stride, sum(n for _, n in runs), runs, kv.interior, scales, kv.num_blocks)
            if t.data_ptr() in seen:  # layers sharing a tensor (HMA groups, cross-layer KV sharing): one region
                i = seen[t.data_ptr()]
                self._marks.add(name, i)
                try:
                    self.layers[i] = join(self.layers[i], replace(geo, name=self.layers[i].name))
                except ValueError as exc:
                    raise RuntimeError(f"PdserveConnector: {exc}") from None
                owner = self.layers[i].name
                self._memory[owner] = byte_region(self._tensors[owner], max(kv.span, len(self._memory[owner])))
                continue
            seen[t.data_ptr()] = len(self.layers)
            self._marks.add(name, len(self.layers))
            self._memory[name] = byte_region(t, kv.span)
            self._tensors[name] = t  # keep alive
            self.layers.append(geo)
            if spec is None or spec.kind != MAMBA:
                self.rank_layers.append(RankLayer(name, kv, ratio))
            self.kv_layouts[name] = kv
            if not dtype or spec is None or spec.kind != MAMBA:
                dtype = str(t.dtype).replace("torch.", "")
        for g in self.layers:
            self.engine.register(g.name, self._memory[g.name])
        dtype += hybrid_tag(self.groups)
        try:
            self.layout = with_blocks(layout_signature(dtype, self.layers, self.block_size), self.layers)
        except ValueError as exc:
            raise RuntimeError(f"PdserveConnector: {exc}; unsupported KV layout") from None
        # heads are sliced across TP degrees for one full-attention group only; a hybrid cache moves rank to rank
        sliceable = self.kv_heads and not self.hybrid
        self.unit = unit_signature(dtype, self.block_size, self.rank_layers) if sliceable else ""
        self.sums = BlockSums(self.layers, self._memory)
        self._cuda = on_cuda(self._memory)
        # layer by layer from host memory (per-layer xxh3u sums) or CUDA memory (wsum32 sums, the fence), unless a
        # drafter with layers runs here: its later draft steps write their tokens' KV into the prompt's last block
        # after its layer was saved (vLLM's wait_for_save comes after the drafting), so it moves whole
        drafter = getattr(getattr(self.vllm_config, "speculative_config", None), "method", None)
        self._by_layer = (self.config.layerwise_kv and (self.sums.alg == XXH3U or self._cuda)
                          and not drafts_with_layers(drafter))
        self.fingerprint = worker_fingerprint(self.vllm_config, self.unit or self.layout.split(PEER_BLOCKS_SEP)[0],
                                              self.block_size, self.tp)
        self.fp_digest = digest(self.fingerprint)
        if self.pool is not None:
            slots = SealSlots()
            self.engine.register(SEAL_REGION, slots.buffer)
            self._pool_io = PoolIO(self.pool, self.layers, self.sums, slots, self.fp_digest, self.config.kv_checksum,
                                   sum(g.block_bytes for g in self.layers))
        first = kv_caches[self.layers[0].name] if self.layers else None
        log.info("worker: registered %d KV layers (%s), per-layer cache %s strides %s on %s, layout %s: %s",
                 len(self.layers), dtype, tuple(first.shape) if first is not None else None,
                 first.stride() if first is not None else None, first.device if first is not None else None,
                 self.kv_layouts[self.layers[0].name].describe() if self.layers else "-", self.layout)

    def _layout(self, name: str, t: torch.Tensor) -> KVLayout:
        """The layer's layout from the backend vLLM chose and its resolved KV cache layout (a Mamba / linear-attention
        layer: its state's bytes, one block per state)."""
        spec = self.layer_groups.get(name)
        if spec is not None and spec.kind == MAMBA:
            try:
                return derive_layout(tuple(t.shape), tuple(t.stride()), t.element_size(), 0, len(t.shape) - 2,
                                     "mamba", "state")
            except LayoutError as exc:
                raise RuntimeError(f"PdserveConnector: Mamba layer {name} on {t.device}: {exc}") from None
        backend = attn_backend(self.vllm_config, name)
        try:
            order = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        except Exception:
            order = None
        model = self.vllm_config.model_config
        heads, head = 0, 0
        try:
            heads = model.get_num_kv_heads(self.vllm_config.parallel_config)
            head = model.get_head_size()
        except Exception:
            pass
        try:
            return layout_of_tensor(t, backend, order, self.block_size, heads, head)
        except LayoutError as exc:
            raise RuntimeError(f"PdserveConnector: layer {name} on {t.device}: {exc}") from None

    def handshake(self) -> PdserveHandshake:
        seg = self.engine.segment()
        return PdserveHandshake(self.engine.engine_id, seg.host, seg.port, self.layout, self.rank, self.kv_heads,
                                self.unit, sum(g.block_bytes for g in self.layers), dict(self.fingerprint),
                                self._by_layer)

    # ---- per step ----
    def start(self, meta: PdserveMeta) -> None:
        leased_at = time.time()
        for req_id, deadline in meta.send.items():
            self._ledger.lease(req_id, deadline)
            tp = meta.send_trace.get(req_id)
            if tp and req_id not in self._lease_spans:
                self._lease_spans[req_id] = (tp, leased_at)
        self._seals.forget(meta.unseal)
        for req_id, blocks in meta.seal.items():
            self._seals.seal(req_id, blocks, sealer(self.sums, self._fault(meta, req_id)))
        for pjob in meta.pool:
            if pjob.save:
                self._ledger.saving(pjob.req_id)
            threading.Thread(target=self._pool_run, args=(pjob,), name=f"pdserve-pool-{pjob.req_id[:24]}",
                             daemon=True).start()
        now: list[threading.Thread] = []
        for job in meta.recv:
            if job.load:
                with self._lock:
                    self._inflight[job.req_id] = job
            th = threading.Thread(target=self._run, args=(job,), name=f"pdserve-read-{job.req_id[:24]}",
                                  daemon=True)
            th.start()
            if job.sync and job.load:
                now.append(th)
        for th in now:  # this step's forward uses these blocks: the reads end (or fail) before it starts
            th.join()

    def _begin_layers(self, meta: PdserveMeta) -> None:
        """P, at the forward's first saved layer (vLLM binds the step's metadata before the forward but calls
        ``start_load_kv`` after it unless a load is synchronous): the early hand-offs whose prompt this forward
        completes, announced layer by layer as it writes them (layerwise_kv; in CUDA memory once the layer's
        kernels ran: :meth:`layer_saved`)."""
        self._marks_meta = meta
        if not meta.ready or not self._by_layer:
            self._marks.end()
            return
        live = [h for h, note in meta.ready.items() if note is not None]
        for handoff in live:
            note = meta.ready[handoff]
            assert note is not None
            self._board.begin(handoff, note)
        self._marks.begin(live)

    def layer_saved(self, layer_name: str, meta: PdserveMeta) -> None:
        """P, the model's thread (vLLM's ``save_kv_layer``, after the layer's attention wrote its KV, or in CUDA
        memory queued its kernels): mark it ready for the hand-offs this forward (``meta``: its step's) completes,
        at once (host memory: a bit under a lock) or once an event recorded now has completed (the fence's
        thread). The forward never waits for the wire."""
        if meta is not self._marks_meta:
            self._begin_layers(meta)
        region = self._marks.saved(layer_name)
        if region is not None:
            live = self._marks.live  # begin/end replace the list, never change it
            self._fence.after(record_event(self._cuda), lambda: self._board.layer(live, region))

    def after_forward(self, meta: PdserveMeta) -> None:
        """P, in ``wait_for_save``: checksum the prompts this step's forward completed (before P answers, so D's
        notification finds them; device memory: the checksums wait for an event recorded after the forward), then
        announce the early hand-offs among them to the D that waits (a D asking for the sums waits for the seal;
        device memory: the announcement waits for that event too, so D never reads KV still being written)."""
        self._marks.end()
        self._marks_meta = None
        ready = record_event(self._cuda) if meta.seal_now or meta.ready else None  # None for host memory
        for req_id, blocks in meta.seal_now.items():
            self._seals.seal(req_id, blocks, sealer(self.sums, self._fault(meta, req_id), ready))
        if meta.ready:
            self._fence.after(ready, lambda: self.announce(meta.ready))

    def announce_tokens(self, tokens: dict[str, ReadyNote | None]) -> None:
        """P: the first token of each hand-off whose D continues after it (None: there is none), for D's second
        question (pdserve.vllm.continuation); after the announcements still waiting for the device."""
        if tokens:
            self._fence.after(None, lambda: self._announce_tokens(tokens))

    def _announce_tokens(self, tokens: dict[str, ReadyNote | None]) -> None:
        for handoff, note in tokens.items():
            if note is None:
                self._board.no_token(handoff)
            else:
                self._board.ready(handoff, note)

    def announce(self, ready: dict[str, ReadyNote | None]) -> None:
        """P: answer the D that waits for each hand-off (None: P's request ended before it could be handed off)."""
        for handoff, note in ready.items():
            if note is None:
                self._board.gone(handoff, "P's request ended before its prompt was computed")
            else:
                self._board.ready(handoff, note)
                log.info("hand-off ready %s", json.dumps({"handoff": handoff, "req": note.req_id, "t": time.time()},
                                                         separators=(",", ":")))

    def _fault(self, meta: PdserveMeta, req_id: str) -> str:
        return meta.faults.get(req_id, "") if self.config.allow_test_faults else ""

    def _peer(self, remote: RemoteParams, rank: int = 0) -> Any:
        """P's rank ``rank``'s segment (fetched once per engine)."""
        engine_id, host, port = remote.rank(rank)
        key = (host, port)
        seg = self._peers.get(key)
        if seg is None or seg.engine_id != engine_id:
            seg = self.engine.fetch_segment(host, port)
            if seg.engine_id != engine_id:
                raise TransferError("peer", f"{host}:{port} is engine {seg.engine_id}, not {engine_id} (P restarted?)")
            self._peers[key] = seg
        return seg

    def _notify_counts(self, remote: RemoteParams) -> dict[int, int]:
        """P rank -> readers it expects, for the P ranks this rank notifies (a refused pairing: release only)."""
        try:
            table = notifiers(remote.kv_heads or self.kv_heads, remote.tp, self.tp)
        except ShardError:
            table = release_notifiers(remote.tp, self.tp)
        return to_notify(table, self.rank)

    def _batches(self, remote: RemoteParams, job: RecvJob) -> dict[int, list[tuple[str, int, str, int, int]]]:
        """P rank -> the entries this rank reads from it: whole blocks from the same rank when P's TP equals
        ours, else our heads' slices from the P ranks holding them."""
        if remote.tp == self.tp:
            if remote.layout and not same_layout(remote.layout, self.layout):
                raise TransferError("layout", f"P's KV layout {remote.layout} != ours {self.layout} (same "
                                              "backend, KV cache layout, dtype and block size on both?)")
            return {self.rank: build_entries(self.layers, job.plan, layout_blocks(remote.layout))}
        if not remote.unit or remote.unit != self.unit:
            raise TransferError("layout", f"P (tp={remote.tp}) KV layout {remote.unit or remote.layout} != ours "
                                          f"(tp={self.tp}) {self.unit or self.layout}")
        slices = plan_slices(self.kv_heads, remote.tp, self.tp, self.rank, remote.kv_heads)
        peer_heads = len(rank_heads(remote.kv_heads, remote.tp, 0))
        return slice_entries(self.rank_layers, job.plan, slices, peer_heads, layout_blocks(remote.layout))

    def _run(self, job: RecvJob) -> None:
        remote, plan = job.remote, job.plan
        t0 = time.perf_counter()
        stats: dict[str, Any] = {"bytes": 0, "ms": 0.0, "blocks": len(plan), "ok": False, "ranks": 1,
                                 "mode": "sync" if job.sync else "async", "t0": time.time()}
        counts = self._notify_counts(remote)
        notified: set[int] = set()
        ok = met = False
        if not job.load:  # nothing to read: only release P's blocks
            self._release_remote(remote, counts, notified, self.config.transfer_deadline_s)
            log.info("request %s: released P's blocks of %s without reading (local prefix hit or abort)",
                     job.req_id, remote.request_id)
            return
        try:
            if job.error:
                raise TransferError("plan", job.error)
            if remote.handoff and self._layerwise(remote):
                job = self._read_layers(job, counts, notified, stats)
                remote, plan = job.remote, job.plan
                t0 = time.perf_counter() - (time.time() - stats["t0"])  # the read's own time: from its first batch
                ok = met = True
            elif remote.handoff:
                job = self._rendezvous(job)
                remote = job.remote
                met = True
                stats["waited_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
                t0, stats["t0"] = time.perf_counter(), time.time()  # the read's own time from here
            if not ok:
                stats["bytes"], stats["peers"] = self._read_whole(job, counts, notified, stats)
                ok = True
        except Exception as exc:  # every failure ends in a recompute, never in partial KV
            stats["error"] = f"{type(exc).__name__}: {exc}"
            log.warning("request %s: KV read (rank %d) from %s:%s failed (%s); vLLM will recompute the prompt",
                        job.req_id, self.rank, remote.host, remote.port, stats["error"])
            if job.sync:  # off the step: a P that does not answer must not hold D's forward any longer
                threading.Thread(target=self._release_remote, args=(remote, counts, set(notified), 2.0),
                                 name=f"pdserve-release-{job.req_id[:24]}", daemon=True).start()
            else:
                self._release_remote(remote, counts, notified, 2.0)
        finally:
            stats["ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            if met and job.continues:  # after the read (exact on recomputed KV too): P's first token
                self._first_token(job, stats)
            stats["t1"] = time.time()
            stats["ok"] = ok
            stats["per_rank"] = {self.rank: [stats["bytes"], stats["ms"]]}
            with self._lock:
                self._done.append((job, ok, stats))
                READ_SIGNAL.ended()
            kv_span("pdserve.kv_read", job.traceparent, stats["t0"], stats["t1"], {**stats, "rank": self.rank})
        if ok:
            log.info("request %s: rank %d read %d blocks (%d B, %s) from %s in %.2f ms (%.2f GB/s)", job.req_id,
                     self.rank, len(plan), stats["bytes"], stats["mode"], remote.request_id, stats["ms"],
                     stats["bytes"] / 1e6 / max(stats["ms"], 1e-6))

    def _first_token(self, job: RecvJob, stats: dict[str, Any]) -> None:
        """D, continuing after P's first token: ask P for it (P answers once sampled; its note may carry it already)
        into ``stats["first_token"]``; without it D's scheduler marks the request and the router hands off serially."""
        remote = job.remote
        if job.first_token is not None:
            stats["first_token"] = job.first_token
            return
        p = self.rank if remote.tp == self.tp else 0
        wait_s = self.config.handoff_wait_s
        try:
            handle = self.engine.submit(self._peer(remote, p), [], "read",
                                        notify=wait_message(remote.handoff, remote.rank(p)[0], wait_s, TOKEN_PREFIX),
                                        deadline_s=wait_s + self.config.clock_margin_s + 1.0)
            handle.result()
            reply = handle.reply if isinstance(handle.reply, dict) else {}
        except Exception as exc:  # (D then hands off serially: exact)
            reply = {"why": f"{type(exc).__name__}: {exc}"}
        t1 = reply.get("t1")
        if reply.get("ok") and isinstance(t1, int) and not isinstance(t1, bool):
            stats["first_token"] = t1
        else:
            stats["token_error"] = str(reply.get("why") or "no answer")

    def _rendezvous(self, job: RecvJob) -> RecvJob:
        """D, an early hand-off: wait for P's answer (each P rank this rank reads from, once its forward wrote the
        prompt), check it against our prompt and fingerprint, and return the job with P's blocks and request id.
        Raises TransferError (the read fails: vLLM recomputes) when P is gone, restarted, or does not answer in time."""
        remote = job.remote
        wait_s = self.config.handoff_wait_s
        ranks = [self.rank] if remote.tp == self.tp else list(range(remote.tp))
        note: ReadyNote | None = None
        for p in ranks:
            handle = self.engine.submit(self._peer(remote, p), [], "read",
                                        notify=wait_message(remote.handoff, remote.rank(p)[0], wait_s),
                                        deadline_s=wait_s + self.config.clock_margin_s + 1.0)
            handle.result()
            reply = handle.reply if isinstance(handle.reply, dict) else {}
            if not reply.get("ok"):
                raise TransferError("handoff", f"P rank {p} has no KV for hand-off {remote.handoff}: "
                                               f"{reply.get('why') or 'no answer'}")
            try:
                note = note or ReadyNote.from_wire(reply)
            except ValueError as exc:
                raise TransferError("handoff", str(exc)) from None
        assert note is not None
        return self._paired(job, note)

    @staticmethod
    def _paired(job: RecvJob, note: ReadyNote) -> RecvJob:
        """``job`` with P's blocks and request id from P's answer ``note``, once it is checked against our prompt
        digest, fingerprint and block count (raises TransferError: D recomputes)."""
        remote = job.remote
        if note.num_tokens != remote.num_tokens or note.prompt_hash != job.expect_hash:
            raise TransferError("handoff", f"P prefilled another prompt ({note.num_tokens} tokens, digest "
                                           f"{note.prompt_hash}) than ours ({remote.num_tokens}, {job.expect_hash})")
        if job.expect_fingerprint:
            diff = differences(note.fingerprint or {}, job.expect_fingerprint) if note.fingerprint else ["none sent"]
            if diff:
                raise TransferError("handoff", f"fingerprint mismatch: {'; '.join(diff)}")
        end = job.first_block + len(job.plan.local)
        if end > len(note.blocks):
            raise TransferError("handoff", f"P holds {len(note.blocks)} blocks, the read needs {end}")
        remote = replace(remote, block_ids=note.blocks, request_id=note.req_id, prompt_hash=note.prompt_hash,
                         lease_deadline=note.lease_deadline, fingerprint=note.fingerprint)
        return replace(job, remote=remote, plan=BlockPlan(job.plan.local, note.blocks[job.first_block:end]),
                       first_token=note.first_token)

    def _read_whole(self, job: RecvJob, counts: dict[int, int], notified: set[int],
                    stats: dict[str, Any]) -> tuple[int, list[int]]:
        """D: read the job's blocks from P in one batch per P rank (the serial path, and early without layers)."""
        remote = job.remote
        batches = self._batches(remote, job)
        deadline_s = self.config.sync_load_deadline_s if job.sync else self.config.transfer_deadline_s
        if remote.lease_deadline:
            deadline_s = min(deadline_s, remote.lease_deadline - self.config.clock_margin_s - time.time())
            if deadline_s <= 0:
                raise TransferError("deadline", "P's lease on the blocks ran out before the read began")
        return self._read(job, batches, counts, notified, deadline_s, stats)

    def _layerwise(self, remote: RemoteParams) -> bool:
        """Whether this early hand-off is read layer by layer: on, P's TP and layout equal ours (a read that
        reshards heads keeps the whole-request path), host memory (per-layer xxh3u sums) or CUDA memory (wsum32)."""
        return (self._by_layer and remote.tp == self.tp
                and (not remote.layout or same_layout(remote.layout, self.layout)))

    def _read_layers(self, job: RecvJob, counts: dict[int, int], notified: set[int],
                     stats: dict[str, Any]) -> RecvJob:
        """D, an early hand-off layer by layer (pdserve.vllm.layerwise): read and verify each layer P announces,
        then notify P (ends its lease); returns the job with P's blocks. Raises as :meth:`_read` does."""
        remote = job.remote
        fault = remote.test_fault if self.config.allow_test_faults else ""
        if fault_hits(fault, "fail", self.rank):
            raise TransferError("test", f"pdserve_test_fault={fault} (P rank {self.rank})")
        pull = LayerPull(self.engine, self._peer(remote, self.rank), remote.rank(self.rank)[0], self.layers,
                         self.sums, self.fp_digest, self.config.kv_checksum, layout_blocks(remote.layout),
                         self._paired, self.config.layer_batch_bytes)

        def deadline(paired: RecvJob) -> float:
            left = self.config.transfer_deadline_s
            if paired.remote.lease_deadline:
                left = min(left, paired.remote.lease_deadline - self.config.clock_margin_s - time.time())
            return left

        out = pull.run(job, self.config.handoff_wait_s, deadline, lambda paired: self._flips(fault, paired.plan.local),
                       self.config.clock_margin_s + 1.0)
        job, remote = out.job, out.job.remote
        # ends P's lease; off the read's path (D's first step need not wait for it; unheard, the lease ends it)
        threading.Thread(target=self._release_remote, args=(remote, counts, notified, self.config.transfer_deadline_s),
                         name=f"pdserve-release-{job.req_id[:24]}", daemon=True).start()
        if fault_hits(fault, "zero", self.rank):
            zero_ranges(self._memory, out.entries)
            log.warning("request %s: pdserve_test_fault=%s: zeroed %d entries read from P rank %d",
                        remote.request_id, fault, len(out.entries), self.rank)
        first = out.spans[0][0] if out.spans else time.time()
        stats.update(bytes=out.nbytes, peers=[self.rank], layerwise=out.batches, layers_early=out.layers_early,
                     spans=[[round(a, 6), round(b, 6)] for a, b in out.spans],
                     waited_ms=round((first - stats["t0"]) * 1e3, 3), t0=first, blocks=len(job.plan),
                     verified=len(job.plan) if self.config.kv_checksum else 0)
        stats["busy_ms"] = round(sum(b - a for a, b in out.spans) * 1e3, 3)
        return job

    def _read(self, job: RecvJob, batches: dict[int, list[tuple[str, int, str, int, int]]],
              counts: dict[int, int], notified: set[int], deadline_s: float,
              stats: dict[str, Any]) -> tuple[int, list[int]]:
        """Read every P rank's batch at once (each notifies that rank), verify the blocks against P's checksums,
        then apply test faults; returns the bytes read and the P ranks read from. Raises on the first failed
        batch, after all have ended, or on a checksum mismatch."""
        remote = job.remote
        fault = remote.test_fault if self.config.allow_test_faults else ""
        handles: dict[int, Any] = {}
        failed: list[Exception] = []
        verify = self.config.kv_checksum
        # a read that reshards heads is checked per head slice against each P rank's answer (pdserve.vllm.head_sums)
        slices = () if remote.tp == self.tp else plan_slices(self.kv_heads, remote.tp, self.tp, self.rank,
                                                             remote.kv_heads)
        flips = self._flips(fault, job.plan.local)
        # what hashes the blocks of our own P rank's batch as they land
        tap = self.verifier.tap(self.sums, job.plan.local, flips) if verify and not slices else None
        named = job.plan.remote if verify else ()  # P's blocks read, for P to checksum if it lacks the lease yet
        for p in sorted(set(batches) | set(counts)):
            if fault_hits(fault, "fail", p):
                failed.append(TransferError("test", f"pdserve_test_fault={fault} (P rank {p})"))
                continue
            heads = [s.peer_head for s in slices if s.peer_rank == p] if verify else []
            note = notify_message(remote.request_id, self.rank, counts.get(p, 1), named, heads) if p in counts \
                else None
            handles[p] = self.engine.submit(self._peer(remote, p), batches.get(p, []), "read", notify=note,
                                            deadline_s=deadline_s, on_frame=tap.frame if tap and p == self.rank
                                            else None)
        total = 0
        for p, handle in handles.items():
            try:
                handle.result()
            except Exception as exc:
                failed.append(exc)
                continue
            if p in counts:
                notified.add(p)
            total += handle.total_bytes
        if failed:
            raise failed[0]
        for slot, k, at, mask in flips if tap is None else ():  # (a tap flips as the units land)
            self.sums.flip_byte(job.plan.local[slot], at, k, mask)
            log.warning("request %s: pdserve_test_fault=%s: flipped byte %d of unit %d of received block %d",
                        remote.request_id, fault, at, k, job.plan.local[slot])
        where = (f"request {job.req_id} (P {remote.host}:{remote.port} request {remote.request_id} -> D rank "
                 f"{self.rank})")
        if verify and slices:
            verify_slices({p: h.reply for p, h in handles.items()}, self.fp_digest, slices, self.rank_layers,
                          self._memory, job.plan.local, job.plan.remote, where, stats)
        elif verify:
            handle = handles.get(self.rank)
            self.verifier.verify(self.sums, self.fp_digest, handle.reply if handle else None, job.plan.local,
                                 job.plan.remote, tap, where, stats)
        for p, entries in batches.items():
            if fault_hits(fault, "zero", p):
                zero_ranges(self._memory, entries)
                log.warning("request %s: pdserve_test_fault=%s: zeroed %d entries read from P rank %d",
                            remote.request_id, fault, len(entries), p)
        return total, sorted(batches)

    def _flips(self, fault: str, blocks: Sequence[int]) -> list[Flip]:
        """Test fault ``flip`` (``flip~SEED``) on this rank: the bytes to corrupt in the read into ``blocks``."""
        if not fault_hits(fault, "flip", self.rank) or not blocks:
            return []
        return placements(fault, [n for _, _, n in self.sums.units(blocks[0])], len(blocks))

    def _pool_run(self, job: PoolJob) -> None:
        """Save the job's blocks to the pool, or load them from it, straight between KV cache and nodes."""
        t0 = time.time()
        good, stats = PoolIO.run_job(self._pool_io, job)
        kv_span("pdserve.pool_save" if job.save else "pdserve.pool_load", job.traceparent, t0, time.time(),
                {**stats, "blocks": len(job.block_ids), "loaded_blocks": None if job.save else good})
        with self._lock:
            self._pool_done.append((job, good, stats))
            READ_SIGNAL.ended()

    def _pool_results(self, recving: set[str], failed: set[str]) -> None:
        """Account finished pool jobs: loads into ``recving``/``failed``, ended saves to the ledger."""
        with self._lock:
            done, self._pool_done = self._pool_done, []
            READ_SIGNAL.collected(len(done))
        for job, good, stats in done:
            data = self.stats.data
            if job.save:
                self._ledger.save_done(job.req_id)
                ok = "error" not in stats
                self._meta.pool[job.req_id] = "saved" if ok else "save_failed"
                data["pool_saves"] += 1
                data["pool_save_failures"] += 0 if ok else 1
                data["pool_saved_blocks"] += stats.get("stored", 0)
                data["pool_save_bytes"] += stats["bytes"]
                data["pool_save_seconds"] += stats.get("io_s", 0.0)
                continue
            recving.add(job.req_id)
            good, tokens = loaded_tokens(job, good, self.block_size)
            data["pool_loads"] += 1
            data["checksum_failures_pool"] += stats.get("seal_failures", 0)
            data["pool_loaded_tokens"] += tokens
            data["pool_load_bytes"] += stats["bytes"]
            data["pool_load_seconds"] += stats.get("io_s", 0.0)
            if good < len(job.block_ids):  # the rest is recomputed: vLLM keeps the valid prefix
                failed.add(job.req_id)
                self._invalid.update(job.block_ids[good:])
                data["pool_load_failures"] += 1
                self._meta.pool[job.req_id] = "load_partial" if good else "load_failed"
            else:
                self._meta.pool[job.req_id] = "loaded"

    def _release_remote(self, remote: RemoteParams, counts: dict[int, int], notified: set[int],
                        deadline_s: float) -> None:
        """Best effort: tell the P ranks this rank notifies (and has not yet) to free the blocks now rather
        than at the lease's end."""
        handles = []
        for p, readers in counts.items():
            if p in notified:
                continue
            try:
                handles.append((p, self.engine.submit(self._peer(remote, p), [], "read",
                                                      notify=notify_message(remote.request_id, self.rank, readers),
                                                      deadline_s=deadline_s)))
            except Exception as exc:
                log.warning("could not tell P rank %d to free %s (%s); its lease will", p, remote.request_id, exc)
        for p, handle in handles:
            try:
                handle.result()
                notified.add(p)
            except Exception as exc:
                log.warning("could not tell P rank %d to free %s (%s); its lease will", p, remote.request_id, exc)

    def _on_notify(self, note: Any) -> Any:
        """D's READ notification: counts toward the lease's end; after a read (the batch moved bytes) it is answered
        with the lease's checksums (kv_checksum on)."""
        msg = note.message
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        wait = parse_wait(text)
        if wait is not None:  # D's rendezvous of an early hand-off: answered once the blocks are announced
            return self._board.wait(*wait)
        layers = parse_layers(text)
        if layers is not None:  # D's layer-wise rendezvous: answered as layers are written, with their sums
            return self._layers_answer(layers)
        token = parse_wait(text, TOKEN_PREFIX)
        if token is not None:  # D's second question: P's first token, once sampled (pdserve.vllm.continuation)
            return self._board.wait_token(*token)
        text, heads = split_heads(text)
        req_id, sender, readers, read = parse_notify(text)
        if is_handoff(req_id):  # D read nothing and never learnt our request id: the board maps it
            self._board.note(req_id, sender, readers)
            return None
        self._ledger.notify(req_id, sender=sender, readers=readers)
        if not self.config.kv_checksum or not getattr(note, "nbytes", 0):
            return None
        reply = self._seals.reply(req_id, self.sums.alg, self.fp_digest, read, self.sums.sums)
        return head_reply(reply, self.sums, self.rank_layers, read, heads) if heads else reply

    def _layers_answer(self, q: Any) -> dict[str, Any]:
        """P's answer to D's layer-wise question (the engine's thread): the board's, plus the checksums of the
        layers D lacks over the blocks D reads (kv_checksum on), keyed by their mask."""
        answer = self._board.wait_layers(q)
        if not answer.get("ok"):
            return answer
        cpu = time.thread_time()  # P's own cost of layer-wise sends (this thread's CPU; the wait above used none)
        full = (1 << len(self.layers)) - 1
        ready = full if answer["done"] else int(answer["layers"], 16) & full
        new = ready & ~q.have
        answer["layers"] = f"{ready:x}"
        if self.config.kv_checksum and new:
            blocks = answer["blocks"][q.first:q.end]
            regions = [i for i in range(len(self.layers)) if new >> i & 1]
            answer.update(sums={f"{new:x}": self.sums.region_sums(blocks, regions)}, alg=self.sums.alg,
                          fpd=self.fp_digest)  # ("fp" is the note's fingerprint)
        with self._lock:
            self.stats.data["layer_answer_seconds"] += time.thread_time() - cpu
        return answer

    def results(self) -> KVConnectorTransferResults:
        recving: set[str] = set()
        failed: set[str] = set()
        self._pool_results(recving, failed)
        released = self._ledger.step()
        self._board.expire()
        self._account_releases(released)
        self._read_results(recving, failed)
        return KVConnectorTransferResults(finished_sending=released.finished_sending, finished_recving=recving,
                                          failed_recving=failed)

    def _account_releases(self, released: Released) -> None:
        now = time.time()
        for req_id, reason in released.lease_ends.items():
            if reason == LEASE:
                log.warning("P request %s: no decode read its KV blocks within the lease; freeing them", req_id)
            else:
                log.info("P request %s: decode read its KV blocks; freeing them", req_id)
            traced = self._lease_spans.pop(req_id, None)
            if traced is not None:  # P's side of the hand-off: held from the lease to D's notification or its end
                kv_span("pdserve.kv_lease", traced[0], traced[1], now,
                        {"released": reason, "rank": self.rank,
                         "error": "no decode read the blocks within the lease" if reason == LEASE else None})
        self._meta.released.update(released.lease_ends)
        self._seals.drop(list(released.lease_ends))
        counts = self._ledger.take_counts()
        self.stats.data["released_notified"] += counts[NOTIFIED]
        self.stats.data["released_lease"] += counts[LEASE]

    def _read_results(self, recving: set[str], failed: set[str]) -> None:
        """Account finished D reads: into ``recving``, failed ones also into ``failed`` + invalid blocks."""
        data = self.stats.data
        with self._lock:
            done, self._done = self._done, []
            READ_SIGNAL.collected(len(done))
            for job, ok, stats in done:
                self._inflight.pop(job.req_id, None)
                if not job.sync:  # a synchronous load's request is running: vLLM expects no finished_recving
                    recving.add(job.req_id)
                self._meta.reads[job.req_id] = stats
                if ok:
                    data["reads"] += 1
                    data["read_bytes"] += stats["bytes"]
                    data["read_seconds"].append(stats["ms"] / 1e3)
                    data["layerwise_reads"] += 1 if stats.get("layerwise") else 0
                    data["layers_early"] += stats.get("layers_early", 0)
                else:
                    if not job.sync:
                        failed.add(job.req_id)
                    self._invalid.update(job.plan.local)
                    data["read_failures"] += 1
                    data["checksum_failures_p2p"] += 1 if stats.get("checksum_failed") else 0

    def take_stats(self) -> PdserveStats | None:
        with self._lock:  # (the engine's threads add P's layer-answer time)
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, PdserveStats()
        return out

    def take_invalid_blocks(self) -> set[int]:
        with self._lock:
            out, self._invalid = self._invalid, set()
        return out

    def take_worker_meta(self) -> PdserveWorkerMeta | None:
        meta = self._meta
        if meta.is_empty():
            return None
        self._meta = PdserveWorkerMeta()
        return meta

    def close(self) -> None:
        READ_SIGNAL.detach()
        self._seals.close()
        if self.pool is not None:
            self.pool.close()
        try:
            self.engine.close()
        except Exception:
            pass
