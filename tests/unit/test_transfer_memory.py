"""Regions of every memory kind: CPU tensors laid out like vLLM's GPU KV caches, staged regions, the
descriptor's memory kind/device, and (where a GPU exists) CUDA tensors."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from pdserve.transfer import SegmentDescriptor, TransferConfig, TransferEngine, TransferError
from pdserve.transfer.regions import RegionTable, byte_tensor, dense_nbytes
from pdserve.transfer.staging import HostMemory

torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NB, BS, H, D = 6, 16, 4, 8  # blocks, block size, kv heads, head dim


def filled(*shape: int) -> torch.Tensor:
    return torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape).to(torch.bfloat16)


def block_bytes(region_bytes: memoryview, offset: int, n: int) -> bytes:
    return bytes(region_bytes[offset : offset + n])


def test_flash_attention_nhd_kv_cache_registers_whole_and_as_separate_k_and_v():
    kv = filled(2, NB, BS, H, D)  # [2, num_blocks, block_size, heads, head_dim]
    table = RegionTable()
    whole = table.register("kv", kv)
    k, v = table.register("k", kv[0]), table.register("v", kv[1])
    esize, block = kv.element_size(), BS * H * D * kv.element_size()
    assert whole.length == kv.numel() * esize and k.length == v.length == NB * block
    assert v.addr == k.addr + k.length == whole.addr + whole.length // 2
    for b in (0, 3, NB - 1):  # block b of V at b * block bytes, as its strides say
        assert block_bytes(v.view, b * block, block) == kv[1, b].contiguous().view(torch.uint8).numpy().tobytes()
        assert kv[1].stride(0) * esize == block


def test_flashinfer_hnd_view_registers_in_memory_order():
    physical = filled(NB, 2, BS, H, D)
    hnd = physical.permute(0, 1, 3, 2, 4)  # [num_blocks, 2, heads, block_size, head_dim], not contiguous
    assert not hnd.is_contiguous() and dense_nbytes(hnd) == physical.numel() * 2
    region = RegionTable().register("kv", hnd)
    assert region.addr == physical.data_ptr() and region.length == physical.numel() * 2
    per_block = 2 * BS * H * D * 2
    assert block_bytes(region.view, 4 * per_block, per_block) == physical[4].view(torch.uint8).numpy().tobytes()


def test_tensors_with_gaps_are_refused_with_a_fix():
    kv = filled(2, NB, BS, H, D)
    for bad in (kv[:, ::2], kv[..., :4], kv.expand(2, NB, BS, H, D)[:, :, ::3]):
        with pytest.raises(TransferError, match="contiguous"):
            RegionTable().register("bad", bad)


def test_byte_tensor_is_the_same_memory_as_the_host_view():
    kv = filled(2, NB, BS, H, D)
    flat = byte_tensor(kv[1])
    assert flat.dtype == torch.uint8 and flat.numel() == kv[1].numel() * 2 and flat.data_ptr() == kv[1].data_ptr()
    region = RegionTable().register("v", kv[1])
    flat[5] = 0xAB
    assert region.view[5] == 0xAB


def test_staged_region_has_no_host_view_and_describes_as_cpu_on_the_same_wire():
    data = np.zeros(4096, np.uint8)
    table = RegionTable()
    region = table.register("staged", HostMemory(memoryview(data), int(data.ctypes.data)))
    assert region.view is None and region.kind == "cpu" and region.part(16, 32)[1:] == (16, 32)
    with pytest.raises(TransferError, match="no host view"):
        region.slice(0, 1)
    with pytest.raises(TransferError) as err:
        region.part(4000, 200)
    assert err.value.code == "bounds"
    table.register("plain", bytearray(10))
    assert table.describe() == {"staged": [int(data.ctypes.data), 4096], "plain": [table.get("plain").addr, 10]}


def test_descriptor_round_trips_memory_kind_and_device_through_msgpack():
    desc = SegmentDescriptor("e1", "10.0.0.1", 7000, 42, "host", {"cpu": [4096, 100], "gpu": [1 << 40, 1 << 30, "cuda", 3]})
    back = SegmentDescriptor.from_wire(msgpack.unpackb(msgpack.packb(desc.to_wire(), use_bin_type=True), raw=False))
    assert back == desc
    assert back.memory("cpu") == ("cpu", 0) and back.memory("gpu") == ("cuda", 3)
    assert back.region_length("gpu") == 1 << 30
    for bad in ([1, 2, "tpu", 0], [1, 2, "cuda"], [1]):
        with pytest.raises(TransferError, match="malformed"):
            SegmentDescriptor.from_wire(dict(desc.to_wire(), regions={"x": bad}))
    with pytest.raises(TransferError) as err:
        back.memory("nope")
    assert err.value.code == "unknown_region"


def test_engine_segment_for_cpu_regions_is_unchanged():
    with TransferEngine(TransferConfig(secret="s" * 16)) as eng:
        arr = np.zeros(64, np.uint8)
        eng.register("a", arr)
        wire = eng.segment().to_wire()
        assert wire["regions"] == {"a": [int(arr.ctypes.data), 64]}
        assert set(wire["backends"].get("local", {})) <= {"uds"}


def test_non_cpu_non_cuda_tensors_are_refused():
    meta = torch.empty(8, device="meta")
    with pytest.raises(TransferError, match="register CPU or CUDA"):
        RegionTable().register("m", meta)


@needs_cuda
def test_cuda_tensor_registers_with_kind_and_device():
    kv = torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda:0")
    region = RegionTable().register("k", kv[0])
    assert region.kind == "cuda" and region.device == 0 and region.view is None
    assert region.describe() == [kv[0].data_ptr(), kv[0].numel() * 2, "cuda", 0]


@needs_cuda
def test_cuda_tensor_moves_byte_exact_over_tcp_staging():
    src = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda")
    cfg = TransferConfig(secret="s" * 16, backend="tcp", staging_chunk_bytes=1 << 20)
    with TransferEngine(cfg) as a, TransferEngine(cfg) as b:
        a.register("src", src)
        b.register("dst", dst)
        a.write(b.segment(), [("src", 0, "dst", 4096, 2 << 20), ("src", 5, "dst", (3 << 20) + 1, 1000)])
        torch.cuda.synchronize()
        assert torch.equal(dst[4096 : 4096 + (2 << 20)], src[: 2 << 20])
        assert torch.equal(dst[(3 << 20) + 1 : (3 << 20) + 1001], src[5:1005])
        assert not dst[:4096].any()
        back = torch.zeros(1000, dtype=torch.uint8, device="cuda")
        a.register("back", back)
        a.read(b.segment(), [("back", 0, "dst", (3 << 20) + 1, 1000)])
        assert torch.equal(back, src[5:1005])


class FakeCudaMemory(HostMemory):
    """Host bytes that describe themselves as cuda:1 (the host copier moves them): routing tests on CPU."""

    kind = "cuda"
    device = 1


def fake_cuda(arr: np.ndarray) -> FakeCudaMemory:
    return FakeCudaMemory(memoryview(arr), int(arr.ctypes.data))


def test_device_regions_route_to_staging_over_tcp_when_no_ipc_is_offered():
    cfg = TransferConfig(secret="s" * 16, staging_chunk_bytes=4096)
    src = np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst, host_dst = np.zeros(1 << 16, np.uint8), np.zeros(100, np.uint8)
    with TransferEngine(cfg) as owner, TransferEngine(cfg) as me:
        owner.register("gpu", fake_cuda(src))
        owner.register("cpu", bytearray(100))
        me.register("gpu", fake_cuda(dst))
        me.register("host", host_dst)
        seg = owner.segment()
        assert seg.regions["gpu"] == [int(src.ctypes.data), 1 << 16, "cuda", 1] and seg.memory("gpu") == ("cuda", 1)
        from pdserve.transfer.batch import TransferEntry
        gpu = [TransferEntry("gpu", 0, "gpu", 0, 10)]
        assert me.choose_backend(seg, None, gpu).name == "tcp"  # no IPC records in a fake-CUDA descriptor
        mixed = [TransferEntry("host", 0, "gpu", 0, 10)]
        assert me.choose_backend(seg, None, mixed).name == "tcp"
        with pytest.raises(TransferError) as err:
            me.choose_backend(seg, "local", gpu)
        assert err.value.code == "unavailable"
        me.read(seg, [("gpu", 100, "gpu", 5000, 30000), ("host", 0, "gpu", 7, 100)])
        assert dst[100:30100].tobytes() == src[5000:35000].tobytes() and not dst[:100].any() and not dst[30100:].any()
        assert host_dst.tobytes() == src[7:107].tobytes()


def test_mooncake_without_gpu_support_refuses_cuda_regions_and_leaves_nothing_registered():
    pytest.importorskip("mooncake.engine")
    from pdserve.transfer.mooncake import cuda_build
    if cuda_build():
        pytest.skip("this Mooncake build supports GPU memory")
    with TransferEngine(TransferConfig(secret="s" * 16, backend="mooncake")) as eng:
        with pytest.raises(TransferError, match="no GPU support"):
            eng.register("gpu", fake_cuda(np.zeros(4096, np.uint8)))
        assert "gpu" not in eng.segment().regions
        eng.register("gpu", np.zeros(4096, np.uint8))  # the name is free again; host memory still registers
