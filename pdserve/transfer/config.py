"""Configuration of one transfer engine (one per process)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..settings.errors import ConfigError
from ..settings.secret import SECRET_ENV, shared_secret
from ..settings.table import BACKENDS
from .errors import TransferError

__all__ = ["BACKENDS", "SECRET_ENV", "TransferConfig", "TransferConfigError"]


class TransferConfigError(TransferError, ConfigError):
    """A transfer-engine setting is wrong (``code`` "config"); a :class:`ConfigError` like every config fault."""

    def __init__(self, message: str) -> None:
        super().__init__("config", message)


def _default_secret() -> str:
    return os.environ.get(SECRET_ENV, "")


@dataclass(frozen=True)
class TransferConfig:
    """Settings of a :class:`~pdserve.transfer.engine.TransferEngine`.

    backend: ``auto`` picks ``local`` (one cross-process copy) for peers on this host and ``tcp``
    otherwise; ``tcp``, ``local``, ``mooncake`` and ``nixl`` force one path.
    secret: shared by every engine of a deployment; connections that cannot prove it are refused.
    streams: parallel TCP connections per peer; large batches are striped across them.
    slice_bytes: a batch is cut into frames of at most this many bytes, the unit of striping (TCP).
    local_slice_bytes: the same for the same-host path, where each frame is one owner-side copy request
    (larger frames: fewer requests; measured best at 16 MiB on 2 cores).
    staging_chunk_bytes: device memory (CUDA) crosses sockets through two pinned host buffers of this
    size: one is copied while the other is sent. Staging runs per frame, so it is a fraction of
    slice_bytes (4 chunks per default frame) for the copies to overlap the socket.
    local_direct: same-host batches of host memory are copied by the initiator under the owner's grant
    (:mod:`pdserve.transfer.direct`), with no request per batch; off, the owner copies each frame on request.
    inline_bytes: a same-host direct batch of at most this many bytes, with no notification and no frame hook, to a
    peer whose grant is already known and current, is copied inside ``submit`` (which returns it finished): below
    about 1 MiB the copy costs about what handing it to an engine thread and back costs. 0: never.
    piece_bytes, tail_slice_bytes: a tcp READ whose caller reads the bytes as they arrive (``submit(on_frame=...)``,
    D's checksum) receives and reports each frame in pieces of at most ``piece_bytes``, so the reader finds them
    in this core's cache; the pieces of a lane's last frame halve down to ``tail_slice_bytes``, so what is left to
    read when the last byte lands is one small piece (:meth:`~pdserve.transfer.tcp.TcpBackend.run`).
    """

    secret: str = field(default_factory=_default_secret)  # not given: $PDSERVE_TRANSFER_SECRET
    host: str = "127.0.0.1"
    advertise_host: str = ""  # address peers should dial when host is a wildcard like 0.0.0.0
    port: int = 0
    backend: str = "auto"
    streams: int = 4
    slice_bytes: int = 4 << 20
    local_slice_bytes: int = 16 << 20
    local_direct: bool = True
    inline_bytes: int = 1 << 20
    staging_chunk_bytes: int = 1 << 20
    piece_bytes: int = 1 << 20
    tail_slice_bytes: int = 256 << 10
    connect_timeout_s: float = 5.0
    default_deadline_s: float = 30.0
    socket_buffer_bytes: int = 4 << 20
    max_iov: int = 512

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        try:
            shared_secret(self.secret, "the transfer engine", "pass TransferConfig(secret=...)", env={})
        except ConfigError as e:
            raise TransferConfigError(str(e)) from None
        if self.backend not in BACKENDS:
            raise TransferConfigError(f"backend {self.backend!r} unknown; choose one of {BACKENDS}")
        if not 0 <= self.port <= 65535:
            raise TransferConfigError(f"port {self.port} out of range 0-65535 (0 picks a free port)")
        if not 1 <= self.streams <= 64:
            raise TransferConfigError(f"streams={self.streams}: use 1 to 64 parallel connections per peer")
        for name in ("slice_bytes", "local_slice_bytes", "staging_chunk_bytes", "piece_bytes", "tail_slice_bytes"):
            if getattr(self, name) < 4096:
                raise TransferConfigError(f"{name}={getattr(self, name)}: use at least 4096 bytes")
        if self.inline_bytes < 0:
            raise TransferConfigError(f"inline_bytes={self.inline_bytes}: use 0 (never) or a size in bytes")
        if not 1 <= self.max_iov <= 1024:
            raise TransferConfigError(f"max_iov={self.max_iov}: use 1 to 1024 (the kernel's IOV_MAX)")
        if self.connect_timeout_s <= 0 or self.default_deadline_s <= 0:
            raise TransferConfigError("connect_timeout_s and default_deadline_s must be positive seconds")
