"""pdserve.transfer: batched zero-copy memory transfers between processes.

Knows nothing of requests, vLLM or HTTP: it moves bytes between registered ranges.

    engine = TransferEngine(TransferConfig(secret=...))
    engine.register("kv", tensor)
    peer = engine.fetch_segment(host, port)          # or a descriptor passed around as msgpack
    handle = engine.submit(peer, [("kv", 0, "kv", 0, n)], Op.WRITE, notify=b"req-1")
    handle.result()
"""

from .batch import BatchHandle, BatchStatus, Op, TransferEntry, merge_contiguous
from .config import TransferConfig
from .descriptor import SegmentDescriptor
from .engine import Notification, TransferEngine
from .errors import TransferError
from .regions import Region

__all__ = [
    "BatchHandle", "BatchStatus", "Notification", "Op", "Region", "SegmentDescriptor",
    "TransferConfig", "TransferEngine", "TransferEntry", "TransferError", "merge_contiguous",
]
