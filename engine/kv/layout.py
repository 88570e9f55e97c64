"""What one replica's KV state looks like from outside: the tensors of a block and of a slot.

A receiver (host tier, storage cluster, SWA slot store, the decode side of a prefill/decode
handoff) preallocates from a ``KvLayout`` and checks that a sender's layout equals its own
before importing: blocks and slots move between runners only when their layouts are equal
(same model, dtype, block size and lookahead). Physical block ids and slot ids are *not* part
of the state: rows are addressed by logical position, so an exported block or slot can be
written under any id of another runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KvTensor:
    """One tensor of a block or slot: ``shape`` per block / per slot, row-major."""

    name: str  # "<layer>.<kind>", e.g. "2.compressed", "0.window"
    layer: int
    kind: str  # block: "compressed", "indexer_keys"; slot: "window", "comp_kv", "comp_gate", "index_kv", "index_gate"
    shape: tuple[int, int]  # (rows, width)
    dtype: torch.dtype
    ratio: int = 0  # block tensors: source tokens per row; slot rings: 0
    span: int = 0  # slot rings: positions a forward reads back (window - 1, 2r or r); blocks: 0

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class KvLayout:
    model_type: str
    dtype: torch.dtype
    block_size: int  # source tokens per block
    lookahead: int  # positions a sequence may roll back
    block_tensors: tuple[KvTensor, ...]
    slot_tensors: tuple[KvTensor, ...]

    @property
    def bytes_per_block(self) -> int:
        return sum(t.nbytes for t in self.block_tensors)

    @property
    def bytes_per_slot(self) -> int:
        return sum(t.nbytes for t in self.slot_tensors)

    def blocks_for(self, num_tokens: int) -> int:
        """Logical blocks a sequence of ``num_tokens`` computed tokens occupies."""
        return -(-num_tokens // self.block_size)
