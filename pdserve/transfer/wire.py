"""Framing on engine connections: a 4-byte length, a msgpack header, then raw payload bytes.

Payload bytes go straight from registered memory to the socket (``sendmsg`` over memoryviews) and
from the socket straight into registered memory (``recvmsg_into``): no intermediate copies.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

import msgpack

from .errors import TransferError

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 16 << 20
_LEN = struct.Struct("!I")
_DISCARD_CHUNK = 1 << 20


def encode(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _advance(views: list[memoryview], sent: int) -> list[memoryview]:
    """Drop ``sent`` bytes from the front of a list of views (no copies)."""
    i = 0
    while i < len(views) and sent >= views[i].nbytes:
        sent -= views[i].nbytes
        i += 1
    rest = views[i:]
    if rest and sent:
        rest[0] = rest[0][sent:]
    return rest


def send_views(sock: socket.socket, views: Sequence[memoryview | bytes], max_iov: int = 512) -> None:
    """Send all bytes of ``views`` in order, gathering up to max_iov buffers per system call."""
    pending = [memoryview(v).cast("B") if not isinstance(v, memoryview) else v for v in views]
    pending = [v for v in pending if v.nbytes]
    while pending:
        sent = sock.sendmsg(pending[:max_iov])
        pending = _advance(pending, sent)


def send_msg(sock: socket.socket, msg: dict[str, Any], payload: Sequence[memoryview] = (),
             max_iov: int = 512) -> None:
    send_views(sock, [encode(msg), *payload], max_iov)


def recv_into_views(sock: socket.socket, views: Sequence[memoryview], max_iov: int = 512) -> None:
    """Fill every view from the socket, scattering up to max_iov buffers per system call."""
    pending = [v for v in views if v.nbytes]
    while pending:
        n = sock.recvmsg_into(pending[:max_iov])[0]
        if n == 0:
            raise TransferError("peer", "connection closed mid-transfer")
        pending = _advance(pending, n)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_views(sock, [memoryview(buf)])
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    (size,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if size > MAX_HEADER_BYTES:
        raise TransferError("protocol", f"header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        msg = msgpack.unpackb(recv_exact(sock, size), raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise TransferError("protocol", f"undecodable header: {exc}") from exc
    if not isinstance(msg, dict) or "t" not in msg:
        raise TransferError("protocol", "header must be a map with a 't' (type) field")
    return msg


def discard(sock: socket.socket, n: int) -> None:
    """Read and drop ``n`` payload bytes so the stream stays in step after a rejected frame."""
    scratch = memoryview(bytearray(min(n, _DISCARD_CHUNK)))
    while n > 0:
        take = min(n, scratch.nbytes)
        recv_into_views(sock, [scratch[:take]])
        n -= take


def raise_if_error(msg: dict[str, Any]) -> dict[str, Any]:
    if msg.get("t") == "err":
        raise TransferError(str(msg.get("code", "peer")), str(msg.get("m", "peer reported an error")))
    return msg


def _mac(secret: str, *parts: bytes) -> bytes:
    return hmac.new(secret.encode(), b"".join(parts), hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: str) -> None:
    """Challenge the connecting peer; raise ``auth`` (after telling it why) unless it knows the secret."""
    nonce = os.urandom(32)
    send_msg(sock, {"t": "hello", "v": PROTOCOL_VERSION, "nonce": nonce})
    msg = recv_msg(sock)
    theirs = msg.get("nonce")
    mac = msg.get("mac")
    if msg.get("t") != "auth" or not isinstance(theirs, bytes) or not isinstance(mac, bytes):
        raise TransferError("protocol", "expected an auth message")
    if not hmac.compare_digest(mac, _mac(secret, b"client", nonce, theirs)):
        send_msg(sock, {"t": "err", "code": "auth", "m": "authentication failed: transfer secrets differ"})
        raise TransferError("auth", "peer failed authentication (wrong shared secret)")
    send_msg(sock, {"t": "ok", "mac": _mac(secret, b"server", theirs, nonce)})


def client_handshake(sock: socket.socket, secret: str) -> None:
    """Prove the secret to the server and check that the server knows it too."""
    hello = recv_msg(sock)
    nonce = hello.get("nonce")
    if hello.get("t") != "hello" or not isinstance(nonce, bytes):
        raise TransferError("protocol", "peer did not greet as a pdserve transfer engine")
    if hello.get("v") != PROTOCOL_VERSION:
        raise TransferError("protocol", f"peer speaks protocol {hello.get('v')}, we speak {PROTOCOL_VERSION}")
    mine = os.urandom(32)
    send_msg(sock, {"t": "auth", "nonce": mine, "mac": _mac(secret, b"client", nonce, mine)})
    reply = raise_if_error(recv_msg(sock))
    if not hmac.compare_digest(reply.get("mac", b""), _mac(secret, b"server", mine, nonce)):
        raise TransferError("auth", "peer failed authentication (wrong shared secret)")
