"""SWA slot store: layout sizes (tiny and V4-Flash-sized stacks), encode/decode, LRU, staging."""

from __future__ import annotations

import threading

import pytest
import torch

from deepinfer.cache.swa_state import RingSpec, SwaArena
from deepinfer.cache.swa_store import SlotEventKind, SlotLayout, SwaSlotStore, SwaStoreError, window_slot_bytes
from deepinfer.kernels import mxfp8


def _specs(num_layers=3, window=16, lookahead=2, head_dim=64, ratio=4):
    specs = []
    for i in range(num_layers):
        specs.append(RingSpec(i, "window", window + lookahead, head_dim))
        if i % 2:
            specs.append(RingSpec(i, "comp_kv", 2 * ratio + lookahead, 2 * head_dim))
            specs.append(RingSpec(i, "comp_gate", 2 * ratio + lookahead, 2 * head_dim))
    return specs


def _arena(specs, num_slots=4, seed=0):
    arena = SwaArena(specs, num_slots=num_slots, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    for s in specs:
        arena.ring(s.layer, s.name).copy_(torch.randn(arena.ring(s.layer, s.name).shape, generator=g))
    return arena


def test_v41_flash_slot_size_matches_spec():
    # V4.1-Flash persists the window rings of its first 20 layers: 128 window + 6 lookahead rows of 512
    specs = [RingSpec(i, "window", 128 + 6, 512) for i in range(20)]
    layout = SlotLayout(specs)
    assert layout.num_bytes == layout.num_window_bytes == 20 * 134 * 528 == 1_415_040
    assert window_slot_bytes(20, 134, 512) == 1_415_040
    # a V4-Flash-sized stack (43 layers) by the same formula
    assert SlotLayout([RingSpec(i, "window", 134, 512) for i in range(43)]).num_bytes == 43 * 134 * 528


def test_tiny_model_slot_size_by_formula():
    from deepinfer.engine.models import build_model
    from deepinfer.engine.models.deepseek_v4.tiny_model import tiny_config

    cfg = tiny_config()
    model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32)
    specs = model.ring_specs(6)
    layout = SlotLayout(specs, carry_dtype=torch.float32)
    windows = [s for s in specs if s.name == "window"]
    assert len(windows) == cfg.num_hidden_layers
    assert layout.num_window_bytes == window_slot_bytes(cfg.num_hidden_layers, cfg.sliding_window + 6, cfg.head_dim)
    assert layout.num_window_bytes == 8 * 134 * 66
    carry = [s.capacity * s.width * 4 for s in specs if s.name != "window"]
    padding = layout.num_bytes - layout.num_window_bytes - sum(carry)
    assert carry and 0 <= padding < 16 * (len(carry) + 1) and layout.num_bytes % 16 == 0


def test_encode_decode_round_trip():
    specs = _specs()
    arena = _arena(specs)
    layout = SlotLayout(specs)
    rings = arena.read_slot(1)
    packed = torch.empty(layout.num_bytes, dtype=torch.uint8)
    layout.encode(rings, packed)
    back = layout.decode(packed, torch.float32)
    assert set(back) == set(rings)
    for key, t in rings.items():
        if key.endswith(".window"):
            assert torch.all((back[key] - t).abs() <= mxfp8.error_bound(t))
            assert not torch.equal(back[key], t)  # really quantised
        else:
            assert torch.equal(back[key], t)  # carry rows are lossless
    arena.write_slot(0, back)  # decoded rings fit the device arena as they are
    assert torch.equal(arena.read_slot(0)["1.comp_kv"], rings["1.comp_kv"])


def test_layout_rejects_wrong_rings():
    specs = _specs()
    layout = SlotLayout(specs)
    rings = _arena(specs).read_slot(0)
    out = torch.empty(layout.num_bytes, dtype=torch.uint8)
    with pytest.raises(SwaStoreError, match="missing"):
        layout.encode({k: v for k, v in rings.items() if k != "0.window"}, out)
    rings["0.window"] = rings["0.window"][:-1]
    with pytest.raises(SwaStoreError, match="0.window has shape"):
        layout.encode(rings, out)
    with pytest.raises(SwaStoreError, match="needs"):
        layout.decode(out[:-1], torch.float32)
    assert SlotLayout(specs).fingerprint == layout.fingerprint != SlotLayout(_specs(head_dim=32)).fingerprint


def test_lru_eviction_and_events():
    specs = _specs()
    arena = _arena(specs)
    store = SwaSlotStore(SlotLayout(specs), num_slots=2)
    assert store.put(b"a", 16, arena.read_slot(0)) and store.put(b"b", 32, arena.read_slot(1))
    assert store.read(b"a", torch.float32)[0] == 16  # a is now most recently used
    assert store.put(b"c", 48, arena.read_slot(2))  # evicts b
    assert store.boundary_of(b"b") is None and store.boundary_of(b"a") == 16 and store.boundary_of(b"c") == 48
    events = store.drain_events()
    assert [(e.kind, e.key) for e in events] == [
        (SlotEventKind.SAVED, b"a"), (SlotEventKind.SAVED, b"b"), (SlotEventKind.EVICTED, b"b"), (SlotEventKind.SAVED, b"c")]
    assert store.drain_events() == []
    assert store.read(b"b", torch.float32) is None and store.num_misses == 1
    store.check_integrity()
    # one arena, allocated once: saving never allocates rows
    assert store.arena.shape == (2, store.layout.num_bytes)


def test_staging_commit_discard_and_no_eviction_of_staged():
    specs = _specs()
    arena = _arena(specs)
    store = SwaSlotStore(SlotLayout(specs), num_slots=2)
    assert store.stage(7, 16, arena.read_slot(0))
    assert store.stage(7, 32, arena.read_slot(1))  # overwrites its own row
    assert store.staged_boundary(7) == 32
    assert store.stage(8, 16, arena.read_slot(2))
    assert not store.stage(9, 16, arena.read_slot(3))  # both rows staged: skipped, nothing evicted
    assert not store.put(b"x", 16, arena.read_slot(3))
    assert store.commit(7, b"k7")
    got = store.read(b"k7", torch.float32)
    assert got[0] == 32 and torch.equal(got[1]["1.comp_gate"], arena.read_slot(1)["1.comp_gate"])
    store.discard(8)
    assert not store.commit(8, b"k8")
    store.check_integrity()
    assert store.num_stored == 1


def test_packed_copy_round_trips_between_stores():
    specs = _specs()
    arena = _arena(specs)
    a, b = SwaSlotStore(SlotLayout(specs), 2), SwaSlotStore(SlotLayout(specs), 2)
    a.put(b"k", 48, arena.read_slot(3))
    num_tokens, packed = a.packed_copy(b"k")
    assert b.put_packed(b"k", num_tokens, packed)
    ra, rb = a.read(b"k", torch.float32)[1], b.read(b"k", torch.float32)[1]
    assert all(torch.equal(ra[k], rb[k]) for k in ra)
    with pytest.raises(SwaStoreError, match="does not fit"):
        b.put_packed(b"z", 16, packed[:-1])


def test_concurrent_stage_and_read():
    specs = _specs()
    arena = _arena(specs)
    store = SwaSlotStore(SlotLayout(specs), num_slots=6)
    rings = arena.read_slot(0)

    def worker(seq):
        for i in range(20):
            store.stage(seq, 16 * (i + 1), rings)
            store.commit(seq, bytes([seq, i % 3]))
            store.read(bytes([seq, (i + 1) % 3]), torch.float32)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.check_integrity()
    assert store.num_stored <= 6 and store.num_saved == 60
