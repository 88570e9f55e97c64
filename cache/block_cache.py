"""Paged device tensors for the prefix-cacheable KV state: compressed rows and indexer keys.

A block holds ``block_size`` *source* tokens of every paged tensor at once, so one physical id
addresses the same token range in all of them (and one block is one unit for the prefix cache
and the storage cluster). A tensor of a ratio-r layer keeps ``block_size // r`` rows per block:

    logical block b of a sequence  ->  physical id table[b]
    compressed row w (source [w*r, (w+1)*r))  ->  block w*r // block_size, row w % (block_size // r)
    flat row id = table[w*r // block_size] * (block_size // r) + w % (block_size // r)

The model declares which tensors exist (``PagedSpec``); this module only owns the memory.

Behind the ``num_blocks`` blocks every tensor has one more, the *dump block* (id ``num_blocks``,
``dump_row``): no sequence ever holds it, and a forward replayed from a CUDA graph points the
writes of its padding (compressed entries added so that a step's shapes stay those of its graph)
at it. Only ``flat`` reaches it; every block-id API keeps to ``[0, num_blocks)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class BlockCacheError(ValueError):
    """An impossible cache geometry or a block id out of range; the message says which."""


@dataclass(frozen=True, slots=True)
class PagedSpec:
    """One paged tensor: ``rows_per_block`` rows of ``width`` values per block."""

    layer: int
    name: str  # e.g. "compressed", "indexer_keys"
    ratio: int  # source tokens per row
    width: int


class BlockCache:
    def __init__(
        self,
        specs: Sequence[PagedSpec],
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 1:
            raise BlockCacheError(f"num_blocks must be >= 1, got {num_blocks}")
        for spec in specs:
            if spec.ratio < 1 or block_size % spec.ratio:
                raise BlockCacheError(
                    f"block_size {block_size} must be a multiple of every compress ratio "
                    f"(layer {spec.layer} {spec.name} has ratio {spec.ratio})"
                )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.specs = tuple(specs)
        # zero-filled: rows never written are read only under a mask and must stay finite; one
        # more block at the end: the dump block (module docstring)
        self._storage = {
            (s.layer, s.name): torch.zeros(num_blocks + 1, block_size // s.ratio, s.width, dtype=dtype, device=device)
            for s in self.specs
        }
        self._tensors: dict[tuple[int, str], torch.Tensor] = {key: t[:num_blocks] for key, t in self._storage.items()}
        # flat row views, made once (a forward asks for them ~40 times per step)
        self._flat = {key: t.view(-1, t.shape[-1]) for key, t in self._storage.items()}

    @property
    def dump_block(self) -> int:
        """The block id padding writes go to (never allocated, never read)."""
        return self.num_blocks

    def dump_row(self, ratio: int) -> int:
        """The flat row of the dump block's first row in a tensor of ``ratio`` source tokens per row."""
        return self.num_blocks * (self.block_size // ratio)

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        """``[num_blocks, rows_per_block, width]`` (the dump block left out)."""
        return self._tensors[(layer, name)]

    def flat(self, layer: int, name: str) -> torch.Tensor:
        """``[(num_blocks + 1) * rows_per_block, width]`` view addressed by flat row ids (the last
        block's rows: the dump block's)."""
        return self._flat[(layer, name)]

    @property
    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._tensors.values())

    def _check_ids(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.num_blocks]
        if bad:
            raise BlockCacheError(f"block ids {bad[:4]} out of range [0, {self.num_blocks})")

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy every paged tensor's rows of block ``src[i]`` into block ``dst[i]``."""
        if len(src) != len(dst):
            raise BlockCacheError(f"copy_blocks got {len(src)} sources and {len(dst)} destinations")
        self._check_ids([*src, *dst])
        if not src:
            return
        first = next(iter(self._tensors.values()), None)
        if first is None:
            return
        s = torch.tensor(list(src), device=first.device)
        d = torch.tensor(list(dst), device=first.device)
        for t in self._tensors.values():
            t[d] = t[s]

    def read_blocks(self, block_ids: Sequence[int], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Copies of the blocks' rows on ``device``, one ``[len(block_ids), rows_per_block, width]``
        tensor per paged tensor keyed ``"<layer>.<name>"`` (entry i is block ``block_ids[i]``)."""
        self._check_ids(block_ids)
        index = self._index(block_ids)
        return {f"{layer}.{name}": t.index_select(0, index).to(device) for (layer, name), t in self._tensors.items()}

    def write_blocks(self, block_ids: Sequence[int], tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite blocks ``block_ids`` with ``tensors`` as ``read_blocks`` returns them (any device,
        same dtype and shapes)."""
        self._check_ids(block_ids)
        if len(set(block_ids)) != len(block_ids):
            raise BlockCacheError(f"write_blocks: duplicate block ids in {list(block_ids)[:8]}")
        self._check_rows("write_blocks", tensors, len(block_ids))
        index = self._index(block_ids)
        for (layer, name), t in self._tensors.items():
            t.index_copy_(0, index, tensors[f"{layer}.{name}"].to(t.device))

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        device = next(iter(self._tensors.values())).device if self._tensors else "cpu"
        return torch.tensor(list(block_ids), dtype=torch.long, device=device)

    def _check_rows(self, what: str, tensors: dict[str, torch.Tensor], num_blocks: int | None) -> None:
        expected = {f"{layer}.{name}" for layer, name in self._tensors}
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            raise BlockCacheError(f"{what}: missing tensors {missing[:4]}, unexpected {extra[:4]}")
        for (layer, name), t in self._tensors.items():
            src, key = tensors[f"{layer}.{name}"], f"{layer}.{name}"
            shape = tuple(t.shape[1:]) if num_blocks is None else (num_blocks, *t.shape[1:])
            if tuple(src.shape) != shape or src.dtype != t.dtype:
                raise BlockCacheError(
                    f"{what}: tensor {key!r} is {tuple(src.shape)} {src.dtype}, expected {shape} {t.dtype}"
                )

    def read_block(self, block_id: int) -> dict[str, torch.Tensor]:
        """Copies of one block's rows, keyed ``"<layer>.<name>"`` (for host tiers and the store)."""
        self._check_ids([block_id])
        return {f"{layer}.{name}": t[block_id].clone() for (layer, name), t in self._tensors.items()}

    def write_block(self, block_id: int, rows: dict[str, torch.Tensor]) -> None:
        self._check_ids([block_id])
        self._check_rows("write_block", rows, None)
        for (layer, name), t in self._tensors.items():
            t[block_id].copy_(rows[f"{layer}.{name}"])
