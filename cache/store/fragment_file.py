"""The on-disk form of one fragment: a self-describing file, shared by storage nodes and the fs backend.

    offset 0        fixed part (FIXED, 56 bytes, little-endian)
                      magic "DIFG" | version | index | k | m | key_len u16 | class_len u16 |
                      object_size u64 | write_id u64 | payload_crc u32 | payload_size u32 |
                      written_at f64 | expires_at f64
    56              key (key_len bytes) | traffic class (class_len bytes, utf-8)
    56+kl+cl        header_crc u32 = CRC-32C of everything above
    ...+4           payload (payload_size bytes; its CRC-32C is payload_crc)

Every file carries its own key, coding position and retention, so a node can rebuild its index
from a directory scan, and any bit flip (header or payload) is caught before a byte is served.
Files live at ``ROOT/<first key byte hex>/<key hex>``: one fragment per key per directory tree
(a node holds at most one fragment of an object; the fs backend holds whole objects).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from deepinfer.cache.store.ec import FragmentHeader, payload_crc

MAGIC = b"DIFG"
VERSION = 1
FIXED = struct.Struct("<4sBBBBHHQQIIdd")
_CRC = struct.Struct("<I")
MAX_KEY_BYTES = 1024
MAX_CLASS_BYTES = 64


class CorruptFragment(ValueError):
    """A fragment file (or received fragment) failed its magic, length or checksum checks."""


@dataclass(frozen=True, slots=True)
class FragmentRecord:
    """A fragment's header plus what the storage side adds: write identity and retention."""

    header: FragmentHeader
    write_id: int  # random per client put: fragments of two writes of one key never mix
    traffic_class: str
    written_at: float
    expires_at: float

    @property
    def key(self) -> bytes:
        return self.header.key


def validate_key(key: bytes) -> None:
    if not key or len(key) > MAX_KEY_BYTES:
        raise ValueError(f"object key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


def pack_prefix(record: FragmentRecord, payload_size: int) -> bytes:
    """Everything in the file before the payload."""
    h = record.header
    validate_key(h.key)
    cls = record.traffic_class.encode()
    if len(cls) > MAX_CLASS_BYTES:
        raise ValueError(f"traffic class {record.traffic_class!r} is over {MAX_CLASS_BYTES} bytes")
    fixed = FIXED.pack(
        MAGIC, VERSION, h.index, h.k, h.m, len(h.key), len(cls), h.object_size, record.write_id,
        h.payload_crc, payload_size, record.written_at, record.expires_at,
    )  # fmt: skip
    body = fixed + h.key + cls
    return body + _CRC.pack(payload_crc(body))


def unpack_prefix(buf) -> tuple[FragmentRecord, int, int]:
    """(record, payload offset, payload size) from the start of a fragment file."""
    view = memoryview(buf)
    if len(view) < FIXED.size:
        raise CorruptFragment(f"fragment file of {len(view)} bytes is shorter than its {FIXED.size}-byte header")
    (magic, version, index, k, m, key_len, class_len, object_size, write_id, crc, payload_size, written_at, expires_at) = (
        FIXED.unpack_from(view)
    )
    if magic != MAGIC or version != VERSION:
        raise CorruptFragment(f"not a fragment file (magic {bytes(magic)!r}, version {version})")
    end = FIXED.size + key_len + class_len
    if len(view) < end + _CRC.size:
        raise CorruptFragment("fragment header is truncated")
    (header_crc,) = _CRC.unpack_from(view, end)
    if payload_crc(view[:end]) != header_crc:
        raise CorruptFragment("fragment header checksum mismatch")
    key = bytes(view[FIXED.size : FIXED.size + key_len])
    traffic_class = bytes(view[FIXED.size + key_len : end]).decode()
    header = FragmentHeader(key, index, k, m, object_size, crc)
    return FragmentRecord(header, write_id, traffic_class, written_at, expires_at), end + _CRC.size, payload_size


def parse(buf) -> tuple[FragmentRecord, memoryview]:
    """Record and payload of a whole fragment file; raises CorruptFragment on any damage."""
    record, offset, size = unpack_prefix(buf)
    payload = memoryview(buf)[offset : offset + size]
    if len(payload) != size:
        raise CorruptFragment(f"payload truncated: {len(payload)} of {size} bytes")
    if payload_crc(payload) != record.header.payload_crc:
        raise CorruptFragment("payload checksum mismatch")
    return record, payload


def fragment_path(root: Path, key: bytes) -> Path:
    hex_key = key.hex()
    return root / hex_key[:2] / hex_key


def write_new_file(path: Path, prefix: bytes, payload, *, fsync: bool = False) -> int:
    """Write ``prefix + payload`` to a fresh file (callers write a temp path, then rename it over
    the final one, so a reader sees the old fragment or the whole new one, never half)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        views = [memoryview(prefix), memoryview(payload).cast("B")]
        expected = sum(v.nbytes for v in views)
        num_bytes = os.writev(fd, views)
        while num_bytes < expected:  # writev may be short: finish with plain writes
            rest = b"".join(bytes(v) for v in views)[num_bytes:]
            num_bytes += os.write(fd, rest)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return num_bytes


def read_file(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def read_prefix(path: Path, max_bytes: int = FIXED.size + MAX_KEY_BYTES + MAX_CLASS_BYTES + 4) -> FragmentRecord:
    """The record only (no payload read or checked): for index rebuilds."""
    with open(path, "rb", buffering=0) as f:
        record, _, _ = unpack_prefix(f.read(max_bytes))
    return record
