"""KV layouts: runs derived from vLLM-like cache tensors, refusals, and a P->D block plan moved by the real
transfer engine between two processes (CPU tensors laid out like the GPU backends' caches)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from pdserve.transfer import TransferConfig, TransferEngine
from pdserve.vllm.layout import KVLayout, LayoutError, derive_layout, dims_from_shape_fn, layout_from_order
from pdserve.vllm.params import (
    LayerGeometry,
    build_entries,
    layout_blocks,
    layout_signature,
    plan_blocks,
    same_layout,
    with_blocks,
)

SECRET = "layout-test-secret-0123456789"
NB, BS, H, D = 6, 16, 2, 8


def flash_attn_shape(nb, bs, h, d):  # FlashAttention NHD: K and V in separate planes
    return (2, nb, bs, h, d)


def flashinfer_shape(nb, bs, h, d):  # FlashInfer HND: K and V joined per block
    return (nb, 2, h, bs, d)


def triton_shape(nb, bs, h, d):  # Triton unified attention: [B, 2, N, H, D]
    return (nb, 2, bs, h, d)


def permuted(shape, order):
    """A tensor of logical ``shape`` whose memory order is ``order`` (as vLLM allocates stride orders)."""
    phys = torch.empty([shape[i] for i in order], dtype=torch.float16)
    inv = [order.index(i) for i in range(len(order))]
    return phys.permute(*inv)


def cases(nb: int = NB):
    return {
        "flash_attn_nhd_split": (torch.empty(flash_attn_shape(nb, BS, H, D), dtype=torch.float16), 1, 2),
        "flashinfer_hnd_joined": (torch.empty(flashinfer_shape(nb, BS, H, D), dtype=torch.float16), 0, 3),
        "triton": (torch.empty(triton_shape(nb, BS, H, D), dtype=torch.float16), 0, 2),
        "flashinfer_permuted_hnd": (permuted(flash_attn_shape(nb, BS, H, D), (1, 0, 3, 2, 4)), 1, 2),
        "heads_outside_blocks": (permuted((nb, H, BS, 2 * D), (1, 0, 2, 3)), 0, 2),  # vLLM LHBNC
        "cpu_bhnc": (torch.empty((nb, H, BS, 2 * D), dtype=torch.float16), 0, 2),
    }


def layout_for(t, bdim, tdim, name="test") -> KVLayout:
    return derive_layout(t.shape, t.stride(), t.element_size(), bdim, tdim, name, "test")


def truth_runs(t, bdim, b):
    """The block's bytes as runs, from the tensor's own [block] slice: every element's address."""
    blk = t.select(bdim, b)
    elem = t.element_size()
    addrs = []
    for pos in torch.cartesian_prod(*[torch.arange(n) for n in blk.shape]).reshape(-1, blk.dim()).tolist():
        addrs.append(blk.data_ptr() + sum(p * s for p, s in zip(pos, blk.stride())) * elem - t.data_ptr())
    addrs.sort()
    runs = []
    for a in addrs:
        if runs and runs[-1][0] + runs[-1][1] == a:
            runs[-1][1] += elem
        else:
            runs.append([a, elem])
    return [tuple(r) for r in runs]


@pytest.mark.parametrize("name", list(cases()))
def test_runs_match_each_block_slice(name):
    t, bdim, tdim = cases()[name]
    kv = layout_for(t, bdim, tdim)
    assert kv.num_blocks == NB and kv.block_tokens == BS
    assert kv.block_bytes == t.select(bdim, 0).numel() * t.element_size()
    for b in range(NB):
        got = [(b * kv.block_stride + off, n) for off, n in kv.runs]
        assert got == truth_runs(t, bdim, b)
        assert t.select(bdim, b).data_ptr() - t.data_ptr() == got[0][0]


def test_split_and_joined_run_counts():
    c = cases()
    assert len(layout_for(*c["flash_attn_nhd_split"]).runs) == 2
    assert len(layout_for(*c["flashinfer_hnd_joined"]).runs) == 1
    assert len(layout_for(*c["cpu_bhnc"]).runs) == 1
    kv = layout_for(*c["flash_attn_nhd_split"])
    assert kv.runs == ((0, BS * H * D * 2), (NB * BS * H * D * 2, BS * H * D * 2))


def test_vllm_order_layouts():
    # vLLM 0.32: logical [B, H, N, C]; LBHNC identity, LBNHC = NHD inside a block, LHBNC = heads outside blocks
    lbhnc = torch.empty((NB, H, BS, 2 * D), dtype=torch.bfloat16)
    kv = layout_from_order(lbhnc.shape, lbhnc.stride(), 2, "CPU_ATTN", "LBHNC", (0, 1, 2, 3))
    assert kv.runs == ((0, H * BS * 2 * D * 2),) and kv.block_stride == H * BS * 2 * D * 2
    lbnhc = torch.empty((NB, BS, H, 2 * D), dtype=torch.bfloat16).permute(0, 2, 1, 3)
    kv = layout_from_order(lbnhc.shape, lbnhc.stride(), 2, "FLASH_ATTN", "LBNHC", (0, 2, 1, 3))
    assert len(kv.runs) == 1
    lhbnc = torch.empty((H, NB, BS, 2 * D), dtype=torch.bfloat16).permute(1, 0, 2, 3)
    kv = layout_from_order(lhbnc.shape, lhbnc.stride(), 2, "FLASH_ATTN", "LHBNC", (1, 0, 2, 3))
    assert len(kv.runs) == H and all(n == BS * 2 * D * 2 for _, n in kv.runs)
    assert [(off, n) for off, n in kv.runs] == truth_runs(lhbnc, 0, 0)
    with pytest.raises(LayoutError, match=r"FLASH_ATTN.*\(6, 2, 16, 16\).*LBHNC"):
        layout_from_order(lbnhc.shape, lbnhc.stride(), 2, "FLASH_ATTN", "LBHNC", (0, 1, 2, 3))


def test_shape_function_finds_block_and_token_dims():
    assert dims_from_shape_fn(flash_attn_shape, flash_attn_shape(NB, BS, H, D), BS, H, D, "FA") == (1, 2)
    assert dims_from_shape_fn(flashinfer_shape, flashinfer_shape(NB, BS, H, D), BS, H, D, "FI") == (0, 3)
    with pytest.raises(LayoutError, match=r"backend FA: KV cache shape \(6, 2, 2, 16, 8\).*unknown"):
        dims_from_shape_fn(flash_attn_shape, flashinfer_shape(NB, BS, H, D), BS, H, D, "FA")


def test_unknown_layout_refused_with_shape_and_strides():
    t = torch.empty((NB, H, BS, 2 * D), dtype=torch.float16)
    strided = t[:, :, :, ::2]  # innermost dim strided
    with pytest.raises(LayoutError, match=r"backend WEIRD: KV cache shape \(6, 2, 16, 8\) strides \(512, 256, 16, 2\)"):
        derive_layout(strided.shape, strided.stride(), 2, 0, 2, "WEIRD", "x")
    with pytest.raises(LayoutError, match="overlapping"):
        derive_layout((NB, 4), (2, 1), 2, 0, 1, "WEIRD", "x")


def test_manager_block_spans_kernel_blocks():
    t, bdim, tdim = cases()["flash_attn_nhd_split"]
    kv = layout_for(t, bdim, tdim)
    stride, runs, scales = kv.manager_runs(2)
    per = BS * H * D * 2
    assert stride == 2 * per and runs == ((0, 2 * per), (NB * per, 2 * per)) and scales == (0, per)


def test_signature_includes_run_structure():
    one = [LayerGeometry("l0", 100, 100)]
    two = [LayerGeometry("l0", 100, 100, ((0, 50), (600, 50)))]
    a, b = layout_signature("float16", one, 16), layout_signature("float16", two, 16)
    assert a != b and "runs1x100" in a and "runs2x50" in b
    assert layout_signature("float16", one, 16) != layout_signature("float16", one, 32)


def test_nhd_and_hnd_blocks_of_equal_size_have_different_signatures():
    hnd = torch.empty((NB, H, BS, 2 * D), dtype=torch.float16)
    nhd = torch.empty((NB, BS, H, 2 * D), dtype=torch.float16).permute(0, 2, 1, 3)
    a, b = layout_for(hnd, 0, 2), layout_for(nhd, 0, 2)
    assert a.runs == b.runs and a.block_stride == b.block_stride and a.interior != b.interior
    sig = [layout_signature("float16", [LayerGeometry("l", k.block_stride, k.block_bytes, k.runs, k.interior)], BS)
           for k in (a, b)]
    assert sig[0] != sig[1]
    bigger = torch.empty((NB + 3, H, BS, 2 * D), dtype=torch.float16)  # D has more blocks than P: same meaning
    assert layout_for(bigger, 0, 2).interior == a.interior


def test_entries_one_per_run_per_block():
    g = LayerGeometry("l0", 64, 32, ((0, 16), (1000, 16)))
    plan = plan_blocks([5, 6, 7], 16, 20, [1, 2, 3], 16)  # partial prefix hit: blocks 1..2
    assert build_entries([g], plan) == [("l0", 6 * 64, "l0", 2 * 64, 16), ("l0", 6 * 64 + 1000, "l0", 2 * 64 + 1000, 16),
                                        ("l0", 7 * 64, "l0", 3 * 64, 16), ("l0", 7 * 64 + 1000, "l0", 3 * 64 + 1000, 16)]


# ---- a P->D plan moved by the real engine between two processes ----

def fill(t: torch.Tensor, seed: int) -> None:
    """Distinct random bytes over the whole cache (its dense storage span)."""
    g = torch.Generator().manual_seed(seed)
    flat = span_bytes(t)
    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g))


def geometry(name: str, t: torch.Tensor, bdim: int, tdim: int) -> LayerGeometry:
    kv = layout_for(t, bdim, tdim)
    return LayerGeometry(name, kv.block_stride, kv.block_bytes, kv.runs, kv.interior, kv.scales, kv.num_blocks)


def span_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat byte view of the tensor's storage span, as the connector registers it."""
    n = layout_for(t, 0, 0).span
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                                  (n,), (1,))


NB_P = NB + 3  # P's cache holds more blocks than D's: K/V planes sit at different offsets on the two sides


@pytest.mark.parametrize("kind, hit_tokens", [("flash_attn_nhd_split", 0), ("flash_attn_nhd_split", BS),
                                              ("flashinfer_permuted_hnd", BS), ("flashinfer_hnd_joined", 0),
                                              ("heads_outside_blocks", BS)])
def test_plan_read_between_processes_is_byte_exact(kind, hit_tokens):
    ctx = mp.get_context("spawn")
    q_up, q_down = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_prefill_main, args=(kind, q_up, q_down), daemon=True)
    p.start()
    try:
        seg, p_bytes = q_up.get(timeout=60)
        t, bdim, tdim = cases()[kind]
        fill(t, 2)
        before = bytes(span_bytes(t).numpy())
        eng = TransferEngine(TransferConfig(secret=SECRET))
        eng.register("layer0", span_bytes(t).numpy())
        geo = geometry("layer0", t, bdim, tdim)
        pt, pb, ptd = cases(NB_P)[kind]
        pgeo = geometry("layer0", pt, pb, ptd)
        assert layout_signature("float16", [geo], BS) == layout_signature("float16", [pgeo], BS)
        local, remote = [4, 0, 5], [1, 7, 2]
        plan = plan_blocks(local, hit_tokens, 3 * BS - hit_tokens - 3, remote, BS)
        entries = build_entries([geo], plan, NB_P)
        assert len(entries) == len(plan) * len(geo.block_runs)
        eng.submit(seg, entries, "read").result(timeout=30)
        after = bytes(span_bytes(t).numpy())
        eng.close()
    finally:
        q_down.put("done")
        p.join(30)
    expect = bytearray(before)
    for lb, rb in zip(plan.local, plan.remote):
        for (off, n), (poff, _) in zip(geo.block_runs, pgeo.block_runs):
            expect[lb * geo.block_stride + off:lb * geo.block_stride + off + n] = \
                p_bytes[rb * pgeo.block_stride + poff:rb * pgeo.block_stride + poff + n]
    assert after == bytes(expect)
    assert after != before
    skipped = local[:hit_tokens // BS]
    for b in skipped:  # the locally hit block stays D's own
        for off, n in geo.block_runs:
            s = b * geo.block_stride + off
            assert after[s:s + n] == before[s:s + n]


def _prefill_main(kind, q_up, q_down):
    t, bdim, tdim = cases(NB_P)[kind]
    fill(t, 1)
    eng = TransferEngine(TransferConfig(secret=SECRET))
    eng.register("layer0", span_bytes(t).numpy())
    q_up.put((eng.segment().to_wire(), bytes(span_bytes(t).numpy())))
    q_down.get(timeout=60)
    eng.close()


def test_planes_after_all_blocks_follow_the_peers_block_count():
    d, p = layout_for(*cases()["flash_attn_nhd_split"]), layout_for(*cases(NB_P)["flash_attn_nhd_split"])
    per = BS * H * D * 2
    assert d.scales == (0, per) and d.runs[1][0] == NB * per and p.runs[1][0] == NB_P * per
    g = LayerGeometry("l", d.block_stride, d.block_bytes, d.runs, d.interior, d.scales, d.num_blocks)
    plan = plan_blocks([2], 0, BS, [5], BS)
    assert build_entries([g], plan, NB_P) == [("l", 2 * per, "l", 5 * per, per),
                                               ("l", NB * per + 2 * per, "l", NB_P * per + 5 * per, per)]
    sig = layout_signature("float16", [g], BS)
    assert with_blocks(sig, [g]) == sig + "+nb6" and layout_blocks(with_blocks(sig, [g])) == NB
    assert same_layout(sig + "+nb6", sig + "+nb9") and not same_layout(sig + "+nb6", "float16/other+nb6")
    joined = layout_for(*cases()["cpu_bhnc"])
    gj = LayerGeometry("l", joined.block_stride, joined.block_bytes, joined.runs, joined.interior, joined.scales,
                       joined.num_blocks)
    assert with_blocks("sig", [gj]) == "sig" and layout_blocks("sig") == 0


def _worker(order):
    from types import SimpleNamespace

    from pdserve.vllm.params import ConnectorConfig
    from pdserve.vllm.worker import WorkerSide

    def resolved():
        return order

    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS, get_resolved_kv_cache_layout=resolved),
                          model_config=None, parallel_config=None)
    return WorkerSide(cfg, ConnectorConfig.from_extra({"secret": SECRET}))


def test_worker_registers_by_vllm_layout_and_refuses_a_disagreeing_tensor():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    w = _worker(KVCacheLayout.LBHNC)
    try:
        caches = {f"layer.{i}": torch.zeros((NB, H, BS, 2 * D), dtype=torch.bfloat16) for i in range(2)}
        w.register_kv_caches(caches)
        per = H * BS * 2 * D * 2
        assert [(g.name, g.block_stride, g.block_runs) for g in w.layers] == [
            ("layer.0", per, ((0, per),)), ("layer.1", per, ((0, per),))]
        assert w.layout.startswith(f"bfloat16/bs{BS}/L2/runs1x{per}/") and layout_blocks(w.layout) == 0
        assert w.engine.segment().regions  # both layers registered with the engine
    finally:
        w.close()
    w = _worker(KVCacheLayout.LBHNC)
    try:
        nhd = torch.zeros((NB, BS, H, 2 * D), dtype=torch.bfloat16).permute(0, 2, 1, 3)
        with pytest.raises(RuntimeError, match=r"layer x.*shape \(6, 2, 16, 16\) strides \(512, 16, 32, 1\).*LBHNC"):
            w.register_kv_caches({"x": nhd})
    finally:
        w.close()
