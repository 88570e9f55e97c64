"""Host-memory SWA slot store: one preallocated arena of fixed-size slots, LRU within capacity.

A *slot* is the whole per-sequence state a model keeps outside its paged blocks (the SwaArena
rings, see cache/swa_state.py) at one *boundary* position ``B``, a multiple of the block size.
It is stored under the prefix hash of block ``B / block_size - 1`` (the hash chain covers every
token below ``B`` and the model/tenant salt), so a later request whose prefix-cache hit ends
exactly at ``B`` can restore it instead of replaying.

Byte layout of one slot (``SlotLayout``; every slot of a model has the same size)::

    | ring 0 | ring 1 | ... |        rings in the model's RingSpec order (carry rings and the
                                     record start on 16-byte boundaries)
    window ring  (capacity rows of head_dim values): MXFP8 rows, D e4m3 + D/32 ue8m0 bytes each
    carry rings  (compressor / indexer carry-over):  raw rows in the runner's dtype

Window rows are the bulk (ARCHITECTURE.md, "Caches": 20 layers x 134 rows x 528 bytes = 1,415,040 per V4.1 slot) and
are only attended to, so MXFP8 costs little. Carry rows are few (``span + lookahead`` on
compressed layers only) and are pooled into compressed rows that enter the block cache, where an
error would persist; they stay lossless.

Arena rows are either *stored* (keyed, in LRU order, evictable) or *staged* (a running
sequence's latest boundary snapshot, held until the sequence finishes or is preempted: then
``commit`` turns it into a stored slot under the boundary's hash, else ``discard`` frees it).
Staged rows are never evicted. Saves and evictions are recorded as ``SlotEvent``s that the owner
drains and publishes to the SWA directory. All methods are thread-safe (the device thread
stages, the engine thread commits and reads).
"""

from __future__ import annotations

import enum
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from deepinfer.cache.block_hash import BlockHash
from deepinfer.cache.swa_state import RingSpec
from deepinfer.kernels import mxfp8

WINDOW_RING = "window"


class SwaStoreError(ValueError):
    """A slot that does not fit the store's layout, or a bad store argument; the message names it."""


def window_slot_bytes(num_layers: int, window_rows: int, head_dim: int) -> int:
    """MXFP8 bytes of the window rings of one slot: layers x rows x (D + D/32).
    V4.1-Flash: 20 persisted layers x 134 rows (128 window + 6 lookahead) x 528 = 1,415,040."""
    return num_layers * window_rows * mxfp8.row_bytes(head_dim)


@dataclass(frozen=True, slots=True)
class RingLayout:
    key: str  # "<layer>.<name>", as SwaArena.read_slot names it
    capacity: int
    width: int
    is_mxfp8: bool
    offset: int  # byte offset inside the slot
    num_bytes: int


class SlotLayout:
    """Where each ring of a slot lives in its fixed-size byte record."""

    def __init__(self, specs: Sequence[RingSpec], *, carry_dtype: torch.dtype = torch.float32,
                 is_window_mxfp8: bool = True) -> None:
        """``is_window_mxfp8=False`` stores window rows raw too (lossless; for checks and tests)."""
        if not specs:
            raise SwaStoreError("a slot layout needs at least one ring spec")
        self.carry_dtype = carry_dtype
        carry_size = torch.empty(0, dtype=carry_dtype).element_size()
        rings, offset = [], 0
        for s in specs:
            is_mxfp8 = is_window_mxfp8 and s.name == WINDOW_RING
            row = mxfp8.row_bytes(s.width) if is_mxfp8 else s.width * carry_size
            if not is_mxfp8:
                offset = _align(offset)  # carry rows are viewed in their dtype: keep them aligned
            rings.append(RingLayout(f"{s.layer}.{s.name}", s.capacity, s.width, is_mxfp8, offset, s.capacity * row))
            offset += s.capacity * row
        self.rings: tuple[RingLayout, ...] = tuple(rings)
        self.num_bytes = _align(offset)  # every arena row starts aligned too
        self.num_window_bytes = sum(r.num_bytes for r in rings if r.key.endswith(f".{WINDOW_RING}"))
        # two processes exchange slots only when they agree on every ring's shape and format
        desc = ";".join(f"{r.key}:{r.capacity}x{r.width}:{'mx' if r.is_mxfp8 else carry_dtype}" for r in rings)
        self.fingerprint = hashlib.blake2b(desc.encode(), digest_size=8).hexdigest()

    def encode(self, rings: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
        """Write ``rings`` (``{key: [capacity, width]}``, any device) into ``out`` (uint8 ``[num_bytes]``)."""
        missing = [r.key for r in self.rings if r.key not in rings]
        if missing or len(rings) != len(self.rings):
            raise SwaStoreError(f"slot rings do not match the layout: missing {missing[:3]}, {len(rings)} given "
                                f"for {len(self.rings)}")
        for r in self.rings:
            t = rings[r.key]
            if tuple(t.shape) != (r.capacity, r.width):
                raise SwaStoreError(f"ring {r.key} has shape {tuple(t.shape)}, the layout expects {(r.capacity, r.width)}")
            dst = out[r.offset : r.offset + r.num_bytes]
            if r.is_mxfp8:
                dst.view(r.capacity, -1).copy_(mxfp8.pack_rows(t))
            else:
                dst.copy_(t.to(self.carry_dtype).contiguous().view(-1).view(torch.uint8))

    def decode(self, packed: torch.Tensor, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """``{key: [capacity, width]}`` in ``dtype`` on ``device`` from one packed slot."""
        if packed.numel() != self.num_bytes or packed.dtype != torch.uint8:
            raise SwaStoreError(f"packed slot has {packed.numel()} {packed.dtype} bytes, the layout needs {self.num_bytes} uint8")
        out = {}
        for r in self.rings:
            src = packed[r.offset : r.offset + r.num_bytes].to(device, non_blocking=True)
            if r.is_mxfp8:
                out[r.key] = mxfp8.unpack_rows(src.view(r.capacity, -1), r.width, dtype)
            else:
                out[r.key] = src.view(self.carry_dtype).view(r.capacity, r.width).to(dtype)
        return out


def _align(num_bytes: int, to: int = 16) -> int:
    return -(-num_bytes // to) * to


class SlotEventKind(enum.IntEnum):
    SAVED = 1
    EVICTED = 2


@dataclass(frozen=True, slots=True)
class SlotEvent:
    kind: SlotEventKind
    key: BlockHash
    num_tokens: int


@dataclass(slots=True)
class _Entry:
    key: BlockHash
    num_tokens: int


class SwaSlotStore:
    def __init__(self, layout: SlotLayout, num_slots: int, *, pin_memory: bool = False) -> None:
        if num_slots < 1:
            raise SwaStoreError(f"the SWA slot store needs num_slots >= 1, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.arena = torch.zeros(num_slots, layout.num_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._key2row: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._row2entry: list[_Entry | None] = [None] * num_slots
        self._seq2row: dict[int, int] = {}  # staged snapshots of running sequences
        self._seq2tokens: dict[int, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._events: list[SlotEvent] = []
        self._lock = threading.Lock()
        self.num_saved = self.num_evicted = self.num_hits = self.num_misses = self.num_stage_skipped = 0

    # ---- lookups ------------------------------------------------------------------------
    @property
    def num_stored(self) -> int:
        return len(self._key2row)

    def boundary_of(self, key: BlockHash) -> int | None:
        """Boundary position of the slot stored under ``key`` (no LRU touch), else None."""
        with self._lock:
            row = self._key2row.get(key)
            return None if row is None else self._row2entry[row].num_tokens

    def stored_boundaries(self) -> list[tuple[BlockHash, int]]:
        """(key, boundary) of every stored slot, least recently used first."""
        with self._lock:
            return [(key, self._row2entry[row].num_tokens) for key, row in self._key2row.items()]

    def read(self, key: BlockHash, dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[int, dict[str, torch.Tensor]] | None:
        """(boundary, decoded rings) of the slot under ``key``, marked most recently used; None on a miss."""
        with self._lock:
            row = self._key2row.get(key)
            if row is None:
                self.num_misses += 1
                return None
            self._key2row.move_to_end(key)
            self.num_hits += 1
            num_tokens = self._row2entry[row].num_tokens
            packed = self.arena[row].clone()  # decoded outside the lock from a private copy
        return num_tokens, self.layout.decode(packed, dtype, device)

    def packed_copy(self, key: BlockHash) -> tuple[int, torch.Tensor] | None:
        """(boundary, a copy of the packed bytes) for sending to another node; None on a miss."""
        with self._lock:
            row = self._key2row.get(key)
            if row is None:
                return None
            self._key2row.move_to_end(key)
            return self._row2entry[row].num_tokens, self.arena[row].clone()

    # ---- saving -------------------------------------------------------------------------
    def stage(self, seq_id: int, num_tokens: int, rings: Mapping[str, torch.Tensor]) -> bool:
        """Overwrite ``seq_id``'s snapshot with its state at boundary ``num_tokens``; False when
        every row is staged by other sequences (nothing changed)."""
        with self._lock:
            row = self._seq2row.get(seq_id)
            if row is None:
                row = self._take_row()
                if row is None:
                    self.num_stage_skipped += 1
                    return False
                self._seq2row[seq_id] = row
            self._seq2tokens[seq_id] = num_tokens
        # encoding outside the lock is safe: only this sequence's (device) thread writes its row
        self.layout.encode(rings, self.arena[row])
        return True

    def staged_boundary(self, seq_id: int) -> int | None:
        with self._lock:
            return self._seq2tokens.get(seq_id)

    def commit(self, seq_id: int, key: BlockHash) -> bool:
        """The staged snapshot of ``seq_id`` becomes the stored slot for ``key`` (replacing an
        older one); False when nothing was staged."""
        with self._lock:
            row = self._seq2row.pop(seq_id, None)
            if row is None:
                return False
            num_tokens = self._seq2tokens.pop(seq_id)
            self._store(key, num_tokens, row)
            return True

    def discard(self, seq_id: int) -> None:
        with self._lock:
            row = self._seq2row.pop(seq_id, None)
            self._seq2tokens.pop(seq_id, None)
            if row is not None:
                self._free.append(row)

    def put(self, key: BlockHash, num_tokens: int, rings: Mapping[str, torch.Tensor]) -> bool:
        """Save decoded rings directly; False when no row can be had."""
        with self._lock:
            row = self._take_row()
            if row is None:
                return False
        try:
            self.layout.encode(rings, self.arena[row])
        except BaseException:
            with self._lock:
                self._free.append(row)
            raise
        with self._lock:
            self._store(key, num_tokens, row)
        return True

    def put_packed(self, key: BlockHash, num_tokens: int, packed: torch.Tensor) -> bool:
        """Save a packed slot fetched from another node; False when no row can be had."""
        if packed.numel() != self.layout.num_bytes:
            raise SwaStoreError(f"packed slot of {packed.numel()} bytes does not fit this store's "
                                f"{self.layout.num_bytes}-byte layout")
        with self._lock:
            row = self._take_row()
            if row is None:
                return False
            self.arena[row].copy_(packed.reshape(-1).view(torch.uint8))
            self._store(key, num_tokens, row)
            return True

    def remove(self, key: BlockHash) -> bool:
        with self._lock:
            row = self._key2row.pop(key, None)
            if row is None:
                return False
            entry = self._row2entry[row]
            self._row2entry[row] = None
            self._free.append(row)
            self._events.append(SlotEvent(SlotEventKind.EVICTED, key, entry.num_tokens))
            self.num_evicted += 1
            return True

    def drain_events(self) -> list[SlotEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    # ---- internals (lock held) ------------------------------------------------------------
    def _take_row(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._key2row:
            return None
        key, row = self._key2row.popitem(last=False)  # least recently used
        entry = self._row2entry[row]
        self._row2entry[row] = None
        self._events.append(SlotEvent(SlotEventKind.EVICTED, key, entry.num_tokens))
        self.num_evicted += 1
        return row

    def _store(self, key: BlockHash, num_tokens: int, row: int) -> None:
        old = self._key2row.pop(key, None)
        if old is not None:  # a newer save of the same boundary replaces the old bytes
            self._row2entry[old] = None
            self._free.append(old)
        self._key2row[key] = row
        self._row2entry[row] = _Entry(key, num_tokens)
        self._events.append(SlotEvent(SlotEventKind.SAVED, key, num_tokens))
        self.num_saved += 1

    def check_integrity(self) -> None:
        with self._lock:
            stored = set(self._key2row.values())
            staged = set(self._seq2row.values())
            free = set(self._free)
            assert len(free) == len(self._free), "a row is free twice"
            assert not (stored & staged or stored & free or staged & free), "a row has two owners"
            assert len(stored) + len(staged) + len(free) == self.num_slots, "a row is lost"
            for key, row in self._key2row.items():
                entry = self._row2entry[row]
                assert entry is not None and entry.key == key, f"row {row} does not hold the slot of its key"
            assert set(self._seq2row) == set(self._seq2tokens), "staged rows and boundaries disagree"
