"""Cross-process memory copy (process_vm_readv / process_vm_writev): one copy, no staging buffer."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import numpy as np

from .errors import TransferError

IOV_MAX = 1024


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_IOV_BYTES = ctypes.sizeof(_IoVec)


_libc = ctypes.CDLL(None, use_errno=True)  # CDLL calls release the GIL while copying
_readv = _libc.process_vm_readv
_writev = _libc.process_vm_writev
for _fn in (_readv, _writev):
    _fn.restype = ctypes.c_ssize_t
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]


def read_word(pid: int, addr: int) -> int:
    """The 8-byte unsigned word at ``addr`` in ``pid``'s memory."""
    word = ctypes.c_uint64(0)
    copy_one(pid, ctypes.addressof(word), addr, 8, pull=True)
    return word.value


def copy_one(pid: int, local: int, remote: int, length: int, pull: bool) -> None:
    """:func:`copy` of one range: ``length`` bytes between our address ``local`` and ``pid``'s ``remote``."""
    iov = (_IoVec * 2)(_IoVec(local, length), _IoVec(remote, length))
    done = (_readv if pull else _writev)(pid, ctypes.addressof(iov), 1, ctypes.addressof(iov) + _IOV_BYTES, 1, 0)
    if done != length:
        _fail(pid, done, length)


def _fail(pid: int, done: int, want: int) -> None:
    err = ctypes.get_errno()
    raise TransferError(
        "peer" if err in (0, 3, 14) else "unavailable",  # ESRCH, EFAULT: peer gone or unmapped
        f"cross-process copy with pid {pid} moved {max(done, 0)} of {want} bytes: {os.strerror(err)}",
    )


def iovecs(pieces: Sequence[tuple[int, int]]) -> np.ndarray:
    """struct iovec[] laid out in a numpy array: one (address, length) row of machine words per piece."""
    return np.array(pieces, dtype=np.uint64).reshape(len(pieces), 2)


def copy(pid: int, local: np.ndarray, remote: np.ndarray, pull: bool) -> None:
    """Copy between this process's ``local`` iovecs and ``pid``'s ``remote`` iovecs ((n, 2) uint64
    arrays of address, length; row i of both has the same length).

    pull=True reads remote -> local, pull=False writes local -> remote. Raises TransferError unless
    every byte moved.
    """
    fn = _readv if pull else _writev
    local = np.ascontiguousarray(local, dtype=np.uint64)
    remote = np.ascontiguousarray(remote, dtype=np.uint64)
    for start in range(0, len(local), IOV_MAX):
        lo, ro = local[start : start + IOV_MAX], remote[start : start + IOV_MAX]
        want = int(lo[:, 1].sum()) if len(lo) > 1 else int(lo[0, 1])
        done = fn(pid, lo.ctypes.data, len(lo), ro.ctypes.data, len(ro), 0)
        if done != want:
            _fail(pid, done, want)
