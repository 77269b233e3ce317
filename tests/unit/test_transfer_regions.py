import mmap

import numpy as np
import pytest

from pdserve.transfer import SegmentDescriptor, TransferError
from pdserve.transfer.regions import RegionTable, as_byte_view


def test_numpy_array_registers_as_flat_bytes_at_its_address():
    arr = np.arange(16, dtype=np.float32).reshape(4, 4)
    view, addr = as_byte_view(arr)
    assert view.nbytes == 64 and addr == arr.ctypes.data
    view[0:4] = b"\x00\x00\x80\x3f"  # writes land in the array: no copy was made
    assert arr[0, 0] == 1.0


def test_bytearray_and_mmap_register():
    table = RegionTable()
    table.register("ba", bytearray(100))
    with mmap.mmap(-1, 8192) as mm:
        region = table.register("mm", mm)
        region.slice(4096, 4)[:] = b"abcd"
        assert mm[4096:4100] == b"abcd"
        del region
        table.unregister("mm")


def test_torch_cpu_tensor_registers_without_copy():
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    view, addr = as_byte_view(t)
    assert view.nbytes == 64 and addr == t.data_ptr()
    view[:2] = b"\x80\x3f"
    assert t[0, 0].item() == 1.0


def test_non_contiguous_and_read_only_buffers_are_refused_with_a_fix():
    arr = np.zeros((4, 4), dtype=np.uint8)
    with pytest.raises(TransferError, match="contiguous"):
        as_byte_view(arr[:, 1])
    with pytest.raises(TransferError, match="read-only"):
        as_byte_view(bytes(10))


def test_bounds_are_checked_on_every_slice():
    table = RegionTable()
    table.register("r", bytearray(100))
    assert table.slice("r", 90, 10).nbytes == 10
    for off, n in [(91, 10), (-1, 5), (0, 101), (100, 1)]:
        with pytest.raises(TransferError) as info:
            table.slice("r", off, n)
        assert info.value.code == "bounds"
    with pytest.raises(TransferError) as info:
        table.slice("nope", 0, 1)
    assert info.value.code == "unknown_region"


def test_duplicate_names_are_refused():
    table = RegionTable()
    table.register("r", bytearray(1))
    with pytest.raises(TransferError, match="already registered"):
        table.register("r", bytearray(1))


def test_descriptor_round_trips_through_msgpack_and_checks_peer_ranges():
    import msgpack

    desc = SegmentDescriptor("e1", "127.0.0.1", 5000, 42, "host", {"kv": [4096, 1000]}, {"local": {"uds": "x"}})
    again = SegmentDescriptor.from_wire(msgpack.unpackb(msgpack.packb(desc.to_wire())))
    assert again == desc
    again.check("kv", 0, 1000)
    with pytest.raises(TransferError):
        again.check("kv", 1, 1000)
    with pytest.raises(TransferError):
        again.check("other", 0, 1)


def test_malformed_descriptor_is_a_protocol_error():
    with pytest.raises(TransferError) as info:
        SegmentDescriptor.from_wire({"engine_id": "x"})
    assert info.value.code == "protocol"
