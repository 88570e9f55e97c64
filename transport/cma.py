"""Linux cross-memory attach: the same-host fast path of the bulk data plane.

Why: between processes on one host, kernel sockets (what ``ipc://`` frames ride on) move data
at a fraction of memcpy speed on small machines, and every chunk costs thread wake-ups. With
``process_vm_readv`` the receiver copies the sender's buffers straight into its own
destination in one system call per buffer: one copy in total, one message each way.

Safety: the receiver only ever writes into buffers it allocated, with lengths it checked; it
reads the sender's memory only after the sender proved its pid (a random ``Proof`` value that
exists only in the sender's memory). A read the kernel refuses (no ptrace permission, e.g.
Yama ``ptrace_scope`` 2, a container without the capability, another pid namespace) fails
with an errno in ``FALLBACK_ERRNOS``; the receiver answers ``UNAVAILABLE`` and the sender
falls back to frames for good.
``allow_readers()`` lets same-user receivers read us under Yama ``ptrace_scope`` 1.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import sys

import numpy as np

PROOF_BYTES = 16
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
# errnos meaning "this path does not work between these two processes" (no permission, or
# the pid is not the sender as seen from here, e.g. another pid namespace): use frames.
FALLBACK_ERRNOS = frozenset({errno.EPERM, errno.EACCES, errno.ENOSYS, errno.ESRCH})


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class CmaError(OSError):
    """A cross-memory read failed (``errno`` set; EPERM family means "not permitted here")."""


_libc = None


def _load_libc():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                       ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        libc.prctl.restype = ctypes.c_int
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _libc = libc
    return _libc


def is_supported() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        _load_libc()
    except (OSError, AttributeError):
        return False
    return True


def allow_readers() -> None:
    """Let any same-user process read this one (Yama ptrace_scope 1); harmless where absent."""
    if is_supported():
        _load_libc().prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


def address_of(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0


def read_into(pid: int, remote_address: int, dest: np.ndarray) -> None:
    """Copy ``dest.nbytes`` bytes from ``remote_address`` in process ``pid`` into ``dest``."""
    if dest.nbytes == 0:
        return
    local = _IoVec(dest.ctypes.data, dest.nbytes)
    remote = _IoVec(remote_address, dest.nbytes)
    num_read = _load_libc().process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if num_read < 0:
        code = ctypes.get_errno()
        raise CmaError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
    if num_read != dest.nbytes:
        raise CmaError(errno.EFAULT, f"process_vm_readv from pid {pid}: {num_read} of {dest.nbytes} bytes")


class Proof:
    """A random value at a fixed address in this process; naming it proves who we are."""

    def __init__(self):
        self._array = np.frombuffer(bytearray(secrets.token_bytes(PROOF_BYTES)), dtype=np.uint8)
        self.value = self._array.tobytes()
        self.address = self._array.ctypes.data


def check_proof(pid: int, address: int, value: bytes) -> None:
    """Raise ``CmaError`` unless process ``pid`` holds ``value`` at ``address``."""
    if len(value) != PROOF_BYTES:
        raise CmaError(errno.EINVAL, "proof of the wrong length")
    seen = np.empty(PROOF_BYTES, dtype=np.uint8)
    try:
        read_into(pid, address, seen)
    except CmaError as exc:  # whatever the reason, this pid cannot be shown to be the sender
        raise CmaError(exc.errno if exc.errno in FALLBACK_ERRNOS else errno.EACCES, f"proof unreadable: {exc}") from None
    if seen.tobytes() != value:
        raise CmaError(errno.EACCES, f"pid {pid} does not hold the sender's proof: not the sender")
