"""A notification's answer (issue 27: P answers D's read notification with its checksums): the receiver's on_notify
callback may return a small msgpack value, which reaches the sender as its batch handle's ``reply``; the
notification says how many bytes its batch moved."""

from __future__ import annotations

import numpy as np

from pdserve.transfer import TransferConfig, TransferEngine

SECRET = "0123456789abcdef-notify-reply"


def test_notification_reply_reaches_the_batch_handle():
    owner, reader = TransferEngine(TransferConfig(secret=SECRET)), TransferEngine(TransferConfig(secret=SECRET))
    try:
        owner.register("mem", np.arange(4096, dtype=np.uint8))
        reader.register("dst", np.zeros(4096, dtype=np.uint8))
        seen = []

        def first(note):
            seen.append((note.message, note.nbytes))
            return {"sums": [1, 2], "for": note.message} if note.nbytes else None

        def broken(note):
            raise RuntimeError("a callback bug must not fail the batch")

        owner.on_notify(broken)
        owner.on_notify(first)
        owner.on_notify(lambda note: "ignored: an earlier callback answered" if note.nbytes else None)
        peer = reader.fetch_segment(owner.segment().host, owner.segment().port)
        handle = reader.submit(peer, [("dst", 0, "mem", 0, 1024)], "read", notify="req-1")
        handle.result()
        assert handle.reply == {"sums": [1, 2], "for": "req-1"}
        empty = reader.submit(peer, [], "read", notify="req-2")  # a notification alone: nothing moved
        empty.result()
        assert empty.reply is None
        plain = reader.submit(peer, [("dst", 0, "mem", 0, 8)], "read")  # no notification, no reply
        plain.result()
        assert plain.reply is None
        assert seen == [("req-1", 1024), ("req-2", 0)]
    finally:
        owner.close()
        reader.close()
