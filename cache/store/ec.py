"""Erasure coding of store objects: k data + m parity fragments, decodable from any k.

    object (object_size bytes)
      |  pyeclib encode (ISA-L Reed-Solomon, Vandermonde by default)
      v
    fragment 0 .. k-1 (data)    fragment k .. k+m-1 (parity)      each = pyeclib header + 1/k of the data
      |  + FragmentHeader(key, index, k, m, object_size, payload_crc)
      v
    one fragment per node of the coding group

pyeclib's own header records the fragment index and the original size, but it happily decodes
fragments of two *different* objects into garbage, and a truncated fragment into garbage too.
Our header binds every fragment to its object key and carries a CRC-32C of the payload, so
``decode`` refuses mixed or damaged inputs instead of returning wrong bytes.

pyeclib accepts only ``bytes`` (a bytearray or memoryview makes its C decoder abort the whole
process), so this module converts at its boundary and nowhere else.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
from pyeclib.ec_iface import ECDriver, ECDriverError

DEFAULT_EC_TYPE = "isa_l_rs_vand"
DEFAULT_K = 10
DEFAULT_M = 2
MAX_FRAGMENTS = 255  # the fragment index is one byte in the on-disk header


class ErasureCodingError(ValueError):
    """Fragments cannot be decoded into the object (too few, mixed, damaged)."""


class NotEnoughFragments(ErasureCodingError):
    """Fewer than k good, distinct fragments of the object were given."""


@dataclass(frozen=True, slots=True)
class ECConfig:
    k: int = DEFAULT_K
    m: int = DEFAULT_M
    ec_type: str = DEFAULT_EC_TYPE

    def __post_init__(self) -> None:
        if self.k < 1 or self.m < 0:
            raise ValueError(f"erasure code needs k >= 1 and m >= 0, got k={self.k} m={self.m}")
        if self.k + self.m > MAX_FRAGMENTS:
            raise ValueError(f"erasure code k+m={self.k + self.m} is over the {MAX_FRAGMENTS}-fragment limit")

    @property
    def num_fragments(self) -> int:
        return self.k + self.m


@dataclass(frozen=True, slots=True)
class FragmentHeader:
    """What binds a fragment to its object: enough to check it without its siblings."""

    key: bytes
    index: int  # 0..k-1 data, k..k+m-1 parity
    k: int
    m: int
    object_size: int
    payload_crc: int  # CRC-32C of the payload


@dataclass(frozen=True, slots=True)
class Fragment:
    header: FragmentHeader
    payload: bytes

    def is_intact(self) -> bool:
        return payload_crc(self.payload) == self.header.payload_crc


def payload_crc(payload) -> int:
    """CRC-32C (Castagnoli), the storage checksum of iSCSI/ext4/Ceph: the crc32c package runs it
    on the CPU's crc32 instruction at memcpy speed (zlib.crc32 is ~3x slower) and releases the
    GIL on large buffers, so daemons verify from worker threads in parallel."""
    return crc32c.crc32c(payload)


class ErasureCodec:
    """Encode objects into fragments and decode them back from any k of them."""

    def __init__(self, config: ECConfig = ECConfig()):
        self.config = config
        if config.m == 0:
            self._driver = None  # k pieces, no parity: a plain split (the fs backend uses k=1)
            return
        try:
            self._driver = ECDriver(k=config.k, m=config.m, ec_type=config.ec_type)
        except ECDriverError as exc:
            raise ValueError(f"erasure code type {config.ec_type!r} is not available here: {exc}") from None
        self._data_offset = self._probe_systematic_layout()

    def _probe_systematic_layout(self) -> int | None:
        """Offset of the data inside a data fragment if the code is systematic, else None.

        With every data fragment at hand, a systematic code's object is just their payloads one
        after the other (after liberasurecode's fixed header): one memcpy instead of a pyeclib
        call plus a copy of each fragment into bytes. Checked here on a few sizes rather than
        assumed, so a backend with another layout simply takes the pyeclib path.
        """
        rng = random.Random(0)
        offset = None
        for size in (1, self.k * 7 + 3, 4099, 65_537):
            data = rng.randbytes(size)
            payloads = self._driver.encode(data)
            guess = len(payloads[0]) - self._driver.get_metadata(payloads[0], formatted=1)["size"]
            if offset not in (None, guess) or _join_data(payloads[: self.k], guess, size) != data:
                return None
            offset = guess
        return offset

    @property
    def k(self) -> int:
        return self.config.k

    @property
    def m(self) -> int:
        return self.config.m

    def encode(self, key: bytes, data) -> list[Fragment]:
        """Split ``data`` (bytes-like, non-empty) into k+m fragments, index order."""
        data = _as_bytes(data)
        if not data:
            raise ValueError(f"object {key.hex()} is empty; the store keeps only non-empty objects")
        payloads = self._driver.encode(data) if self._driver is not None else _split(data, self.k)
        return [
            Fragment(FragmentHeader(key, i, self.k, self.m, len(data), payload_crc(p)), p)
            for i, p in enumerate(payloads)
        ]

    def decode(self, fragments: Sequence[Fragment], *, verify: bool = True) -> bytes:
        """The object from any k distinct fragments of it (extra ones are ignored).

        ``verify`` re-checks each payload's CRC; callers whose fragments were already verified
        (a storage node checks before serving) pass False to save a pass over the data.
        """
        chosen = self._choose(fragments, verify)
        object_size = chosen[0].header.object_size
        if self._driver is None:
            return _join_data([f.payload for f in chosen], 0, object_size)
        if self._data_offset is not None and chosen[-1].header.index == self.k - 1:  # all data fragments
            return _join_data([f.payload for f in chosen], self._data_offset, object_size)
        payloads = [_as_bytes(f.payload) for f in chosen]
        try:
            data = self._driver.decode(payloads)
        except ECDriverError as exc:
            raise ErasureCodingError(f"object {chosen[0].header.key.hex()}: decode failed: {exc}") from None
        if len(data) != chosen[0].header.object_size:
            raise ErasureCodingError(
                f"object {chosen[0].header.key.hex()}: decoded {len(data)} bytes, header says {chosen[0].header.object_size}"
            )
        return data

    def _choose(self, fragments: Sequence[Fragment], verify: bool) -> list[Fragment]:
        if not fragments:
            raise NotEnoughFragments(f"no fragments given; need {self.k}")
        first = fragments[0].header
        if (first.k, first.m) != (self.k, self.m):
            raise ErasureCodingError(
                f"object {first.key.hex()} was coded k={first.k} m={first.m}; this codec is k={self.k} m={self.m}"
            )
        by_index: dict[int, Fragment] = {}
        for f in fragments:
            h = f.header
            if (h.key, h.k, h.m, h.object_size) != (first.key, first.k, first.m, first.object_size):
                raise ErasureCodingError(
                    f"fragments of different objects mixed: {first.key.hex()} (k={first.k} m={first.m} "
                    f"size={first.object_size}) vs {h.key.hex()} (k={h.k} m={h.m} size={h.object_size})"
                )
            if not 0 <= h.index < h.k + h.m:
                raise ErasureCodingError(f"fragment index {h.index} outside 0..{h.k + h.m - 1}")
            if h.index in by_index or (verify and not f.is_intact()):
                continue
            by_index[h.index] = f
            if len(by_index) == self.k:
                break
        if len(by_index) < self.k:
            raise NotEnoughFragments(
                f"object {first.key.hex()}: {len(by_index)} good distinct fragments, need {self.k}"
            )
        # Data fragments first: with all of 0..k-1 present ISA-L just concatenates.
        return [by_index[i] for i in sorted(by_index)]


def _join_data(payloads: Sequence, offset: int, object_size: int) -> bytes:
    """Data fragments 0..k-1 (each ``offset`` header bytes + an equal share) -> the object."""
    parts, remaining = [], object_size
    for payload in payloads:
        view = memoryview(payload).cast("B")[offset:]
        parts.append(view[: min(remaining, view.nbytes)])
        remaining -= parts[-1].nbytes
    if remaining:
        raise ErasureCodingError(f"data fragments hold {object_size - remaining} of {object_size} bytes")
    return b"".join(parts)


def _split(data: bytes, k: int) -> list[bytes]:
    step = -(-len(data) // k)
    return [data[i * step : (i + 1) * step] for i in range(k)]


def _as_bytes(buf) -> bytes:
    if isinstance(buf, bytes):
        return buf
    if type(buf).__module__.startswith("torch"):  # a tensor (any dtype, any device): its raw bytes
        import torch

        buf = buf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return memoryview(buf).cast("B").tobytes()
