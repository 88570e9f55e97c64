"""SWA slot arena: position-addressed rings and whole-slot moves."""

from __future__ import annotations

import pytest
import torch

from deepinfer.cache.swa_state import RingSpec, SwaArena, SwaStateError

SPECS = [RingSpec(0, "window", 22, 8), RingSpec(1, "window", 22, 8), RingSpec(1, "comp_kv", 14, 16)]


def make():
    return SwaArena(SPECS, num_slots=3, dtype=torch.float32, device="cpu")


def test_ring_rows_are_addressed_by_position_modulo_capacity():
    arena = make()
    assert arena.ring(1, "comp_kv").shape == (3, 14, 16)
    flat = arena.flat(0, "window")
    slot, pos = 2, 47
    flat[slot * 22 + pos % 22] = 1.5
    assert torch.all(arena.ring(0, "window")[2, 47 % 22] == 1.5)
    assert arena.bytes_per_slot == (22 * 8 * 2 + 14 * 16) * 4


def test_slot_copy_read_write_and_errors():
    arena = make()
    for spec in SPECS:
        arena.ring(spec.layer, spec.name).normal_()
    saved = arena.read_slot(1)
    arena.copy_slot(1, 0)
    assert all(torch.equal(saved[k], v) for k, v in arena.read_slot(0).items())
    arena.ring(0, "window")[2].zero_()
    arena.write_slot(2, saved)
    assert all(torch.equal(saved[k], v) for k, v in arena.read_slot(2).items())
    with pytest.raises(SwaStateError, match="out of range"):
        arena.read_slot(3)
    with pytest.raises(SwaStateError, match="missing rings"):
        arena.write_slot(0, {})
    with pytest.raises(SwaStateError, match="capacity and width"):
        SwaArena([RingSpec(0, "window", 0, 8)], num_slots=1, dtype=torch.float32, device="cpu")
