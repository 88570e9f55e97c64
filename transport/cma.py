"""Linux cross-memory attach: the same-host fast path of the bulk data plane.

Why: between processes on one host, kernel sockets (what ``ipc://`` frames ride on) move data
at a fraction of memcpy speed on small machines, and every chunk costs thread wake-ups in
libzmq. Instead the sender names its buffers' addresses on a Unix-socket side channel next to
the receiver's ``ipc://`` path and the receiver copies them straight into its destination with
one ``process_vm_readv`` each: one copy in total, one small message each way, no libzmq thread.

Safety: the receiver learns the sender's pid from the kernel (``SO_PEERCRED``), never from the
message, so a peer can only make the receiver read that peer's own memory; it only writes
into buffers it allocated, with lengths it checked. Where the kernel refuses the read (no
ptrace permission: Yama ``ptrace_scope`` 2, a container without the capability, another
user) the errno is in ``FALLBACK_ERRNOS``: the receiver answers ``UNAVAILABLE`` and the sender
sends frames from then on. ``allow_readers()`` lets same-user receivers read us under Yama
``ptrace_scope`` 1.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import socket
import struct
import sys

import numpy as np

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
FALLBACK_ERRNOS = frozenset({errno.EPERM, errno.EACCES, errno.ENOSYS, errno.ESRCH})
SIDE_SUFFIX = ".cma"  # side-channel socket path = the ipc:// path + this
_LENGTH = struct.Struct("<I")
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class CmaError(OSError):
    """A cross-memory read failed (``errno`` set; see ``FALLBACK_ERRNOS``)."""


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


# ---- side channel: [u32le length, msgpack body] frames on a Unix stream socket ----------------


def side_path(address: str) -> str | None:
    """The side-channel socket path for an ``ipc://`` address (None for other transports)."""
    return address.removeprefix("ipc://") + SIDE_SUFFIX if address.startswith("ipc://") else None


def peer_pid(writer: asyncio.StreamWriter) -> int:
    """The connected peer's pid as the kernel saw it (in our pid namespace)."""
    sock = writer.get_extra_info("socket")
    pid, _, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid


def write_frame(writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(_LENGTH.pack(len(body)) + body)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """One frame; raises ``ValueError`` for a frame over ``max_bytes`` (the stream is then
    unusable), ``asyncio.IncompleteReadError`` when the peer hung up."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > max_bytes:
        raise ValueError(f"side-channel frame of {length} bytes is over the {max_bytes}-byte limit")
    return await reader.readexactly(length)
