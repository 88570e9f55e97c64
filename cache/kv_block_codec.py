"""One paged KV block as bytes: what the host tier keeps and the storage cluster stores.

A block holds ``block_size`` source tokens of every paged tensor (block_cache.py). Its bytes are
those tensors' rows laid end to end in layout order, raw (no per-block header):

    [layer 1 "compressed" rows][layer 1 "indexer_keys" rows][layer 2 "compressed" rows] ...
     rows_per_block * width * itemsize bytes each, in the dtype the device cache holds

The layout's ``fingerprint`` (tensor names, shapes, dtypes) goes into every store key
(kv_tiers.py), so an engine never reads blocks written by an engine with another model geometry
or cache dtype; a payload of the wrong size is refused on unpack.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


class BlockCodecError(ValueError):
    """A payload or a set of tensors that does not match the block layout."""


@dataclass(frozen=True, slots=True)
class BlockTensorSpec:
    key: str  # "<layer>.<kind>", as ModelRunner.read_blocks names it
    shape: tuple[int, ...]  # one block's rows: (rows_per_block, width)
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class BlockCodec:
    def __init__(self, specs: Sequence[BlockTensorSpec]):
        if not specs:
            raise BlockCodecError("a block layout needs at least one tensor (the model has no paged KV state)")
        self.specs = tuple(specs)
        self.num_bytes = sum(s.num_bytes for s in self.specs)
        desc = ";".join(f"{s.key}:{'x'.join(map(str, s.shape))}:{s.dtype}" for s in self.specs)
        self.fingerprint = hashlib.blake2b(desc.encode(), digest_size=8, person=b"deepinfer-kvlay").digest()

    @classmethod
    def from_kv_layout(cls, layout) -> "BlockCodec":
        """The block part of a runner's ``kv_layout()`` (engine/kv/layout.py; duck-typed so that
        cache/ does not import engine/): ``block_tensors`` with ``name``, ``shape``, ``dtype``."""
        return cls([BlockTensorSpec(t.name, tuple(t.shape), t.dtype) for t in layout.block_tensors])

    def pack(self, rows: Mapping[str, torch.Tensor]) -> bytes:
        """One block's tensors (any device) -> bytes. Copies to host memory: call it off the
        step's critical path (the write-behind thread)."""
        if len(rows) != len(self.specs):
            raise BlockCodecError(f"block has {len(rows)} tensors, the layout has {len(self.specs)}")
        parts = []
        for s in self.specs:
            t = rows.get(s.key)
            if t is None or tuple(t.shape) != s.shape or t.dtype != s.dtype:
                got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
                raise BlockCodecError(f"block tensor {s.key!r}: expected {s.shape} {s.dtype}, got {got}")
            # uint8 view: works for every dtype numpy lacks (bfloat16, float8)
            parts.append(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return b"".join(parts)

    def unpack(self, data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
        """bytes -> host tensors keyed like ``pack``'s input."""
        if len(data) != self.num_bytes:
            raise BlockCodecError(f"block payload is {len(data)} bytes, the layout needs {self.num_bytes}")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for s in self.specs:
            n = s.num_bytes
            t = torch.empty(s.shape, dtype=s.dtype)
            t.view(-1).view(torch.uint8).copy_(buf[offset : offset + n])
            out[s.key] = t
            offset += n
        return out

    def pack_many(self, stacked: Mapping[str, torch.Tensor]) -> list[bytes]:
        """``ModelRunner.read_blocks`` output (per tensor ``[n, rows, width]``) -> n payloads."""
        n = next(iter(stacked.values())).shape[0] if stacked else 0
        return [self.pack({key: t[i] for key, t in stacked.items()}) for i in range(n)]

    def unpack_many(self, payloads: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """n payloads -> per tensor ``[n, rows, width]``, as ``ModelRunner.write_blocks`` takes them."""
        blocks = [self.unpack(p) for p in payloads]
        return {s.key: torch.stack([b[s.key] for b in blocks]) for s in self.specs}
