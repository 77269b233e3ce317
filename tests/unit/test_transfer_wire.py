import socket
import threading

import pytest

from pdserve.transfer import TransferConfig, TransferError, wire


def _pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    return a, b


def _handshake(server_secret, client_secret):
    a, b = _pair()
    outcome = {}

    def server():
        try:
            wire.server_handshake(a, server_secret)
            outcome["server"] = "ok"
        except TransferError as exc:
            outcome["server"] = exc.code

    t = threading.Thread(target=server)
    t.start()
    try:
        wire.client_handshake(b, client_secret)
        outcome["client"] = "ok"
    except TransferError as exc:
        outcome["client"] = exc.code
    t.join()
    a.close()
    b.close()
    return outcome


def test_handshake_accepts_the_shared_secret():
    assert _handshake("s" * 16, "s" * 16) == {"server": "ok", "client": "ok"}


def test_handshake_refuses_a_wrong_secret_on_both_sides():
    assert _handshake("s" * 16, "t" * 16) == {"server": "auth", "client": "auth"}


def test_scatter_gather_round_trip_with_partial_reads():
    a, b = _pair()
    src = [memoryview(bytes([i]) * n) for i, n in enumerate([1, 70000, 3, 1 << 20])]
    dst = [memoryview(bytearray(v.nbytes)) for v in src]
    t = threading.Thread(target=wire.send_msg, args=(a, {"t": "w"}, src, 2))
    t.start()
    assert wire.recv_msg(b) == {"t": "w"}
    wire.recv_into_views(b, dst, max_iov=2)
    t.join()
    assert [bytes(d) for d in dst] == [bytes(s) for s in src]


def test_peer_closing_mid_payload_is_an_error_not_a_hang():
    a, b = _pair()
    a.sendall(b"abc")
    a.close()
    with pytest.raises(TransferError) as info:
        wire.recv_into_views(b, [memoryview(bytearray(10))])
    assert info.value.code == "peer"


def test_garbage_and_oversized_headers_are_protocol_errors():
    a, b = _pair()
    a.sendall(b"\x00\x00\x00\x03\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    with pytest.raises(TransferError) as info:
        wire.recv_msg(b)
    assert info.value.code == "protocol"
    a.sendall(b"\xff\xff\xff\xff")
    with pytest.raises(TransferError, match="exceeds"):
        wire.recv_msg(b)
    a.sendall(wire.encode({"no_type": 1}))
    with pytest.raises(TransferError, match="type"):
        wire.recv_msg(b)


def test_error_replies_raise_with_their_code():
    with pytest.raises(TransferError) as info:
        wire.raise_if_error({"t": "err", "code": "bounds", "m": "outside"})
    assert info.value.code == "bounds"


def test_config_validation_says_how_to_fix(monkeypatch):
    monkeypatch.delenv("PDSERVE_TRANSFER_SECRET", raising=False)
    with pytest.raises(TransferError, match="PDSERVE_TRANSFER_SECRET"):
        TransferConfig()
    monkeypatch.setenv("PDSERVE_TRANSFER_SECRET", "e" * 16)
    assert TransferConfig().secret == "e" * 16
    with pytest.raises(TransferError, match="choose one of"):
        TransferConfig(backend="carrier-pigeon")
    with pytest.raises(TransferError, match="streams"):
        TransferConfig(streams=0)
