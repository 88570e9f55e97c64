"""Per-sequence SWA slot arena on the device: position-addressed rings, one fixed-size slot each.

A slot holds everything a sequence carries from one forward to the next besides its paged blocks:
each layer's last ``sliding_window`` K=V rows and the compressors' carry-over rows (projected
kv/gate of source tokens whose window has not closed yet, plus the previous window for the
overlapping CSA series). Every ring stores position p at row ``p % capacity``:

    capacity = span + lookahead       span: rows a forward may read back (window, r or 2r)

    ring rows:   ... | p-span+1 ... p-1 | p ... p+lookahead-1 |
                       read by the next     written by a speculative run, still
                       forward              overwritable after a rollback

so lowering a sequence's length by up to ``lookahead`` positions and recomputing is exact:
positions that the recomputation reads were never overwritten. The model declares its rings
(``RingSpec``); this module owns the memory and moves whole slots.

Behind the ``num_slots`` slots every ring has one more, the *dump slot* (id ``num_slots``): no
sequence holds it; the padding steps a forward replayed from a CUDA graph adds (so that its
token count is its graph's) read and write it. Only ``flat`` reaches it; every slot API keeps to
``[0, num_slots)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class SwaStateError(ValueError):
    """A bad ring spec or slot id; the message names it."""


@dataclass(frozen=True, slots=True)
class RingSpec:
    layer: int
    name: str  # e.g. "window", "comp_kv", "comp_gate", "index_kv", "index_gate"
    capacity: int
    width: int


class SwaArena:
    def __init__(
        self,
        specs: Sequence[RingSpec],
        *,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_slots < 1:
            raise SwaStateError(f"num_slots must be >= 1, got {num_slots}")
        for s in specs:
            if s.capacity < 1 or s.width < 1:
                raise SwaStateError(f"ring {s.layer}.{s.name} needs capacity and width >= 1, got {s}")
        self.num_slots = num_slots
        self.specs = tuple(specs)
        # zero-filled: rows never written are read only under a mask and must stay finite
        storage = {  # one more slot at the end: the dump slot (module docstring)
            (s.layer, s.name): torch.zeros(num_slots + 1, s.capacity, s.width, dtype=dtype, device=device)
            for s in self.specs
        }
        self._rings: dict[tuple[int, str], torch.Tensor] = {key: t[:num_slots] for key, t in storage.items()}
        # flat row views, made once (a forward asks for them ~40 times per step)
        self._flat = {key: t.view(-1, t.shape[-1]) for key, t in storage.items()}

    @property
    def dump_slot(self) -> int:
        """The slot padding steps use (never given to a sequence)."""
        return self.num_slots

    def ring(self, layer: int, name: str) -> torch.Tensor:
        """``[num_slots, capacity, width]`` (the dump slot left out)."""
        return self._rings[(layer, name)]

    def flat(self, layer: int, name: str) -> torch.Tensor:
        """``[(num_slots + 1) * capacity, width]`` view: row id = slot * capacity + position % capacity
        (the last slot's rows: the dump slot's)."""
        return self._flat[(layer, name)]

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._rings.values())

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise SwaStateError(f"slot {slot} out of range [0, {self.num_slots})")

    def copy_slot(self, src: int, dst: int) -> None:
        self._check_slot(src)
        self._check_slot(dst)
        for t in self._rings.values():
            t[dst].copy_(t[src])

    def read_slot(self, slot: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Copies of one slot's rings ``[capacity, width]`` keyed ``"<layer>.<name>"`` (for the slot
        store / handoff), on ``device`` (default: the arena's)."""
        self._check_slot(slot)
        return {
            f"{layer}.{name}": t[slot].clone() if device is None else t[slot].to(device, copy=True)
            for (layer, name), t in self._rings.items()
        }

    def write_slot(self, slot: int, rings: dict[str, torch.Tensor]) -> None:
        """Overwrite one slot with rings as ``read_slot`` returns them (any device, same dtype and shapes)."""
        self._check_slot(slot)
        expected = {f"{layer}.{name}" for layer, name in self._rings}
        if set(rings) != expected:
            missing, extra = sorted(expected - set(rings)), sorted(set(rings) - expected)
            raise SwaStateError(f"write_slot: missing rings {missing[:4]}, unexpected {extra[:4]}")
        for (layer, name), t in self._rings.items():
            src = rings[f"{layer}.{name}"]
            if tuple(src.shape) != tuple(t.shape[1:]) or src.dtype != t.dtype:
                raise SwaStateError(
                    f"write_slot: ring '{layer}.{name}' is {tuple(src.shape)} {src.dtype}, "
                    f"expected {tuple(t.shape[1:])} {t.dtype}"
                )
        for (layer, name), t in self._rings.items():
            t[slot].copy_(rings[f"{layer}.{name}"])
