"""SWA slot ids: each running sequence owns one fixed-size sliding-window slot.

Only the ids live here (the memory is cache/swa_state.py). The number of slots is the engine's
maximum concurrency.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class SlotPoolError(RuntimeError):
    """A slot was freed twice or never handed out."""


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"SlotPool needs num_slots >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._is_used = [False] * num_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.popleft()
        self._is_used[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not self._is_used[slot]:
            raise SlotPoolError(f"slot {slot} freed but not in use")
        self._is_used[slot] = False
        self._free.append(slot)

    def check_integrity(self, holders: Iterable[int] | None = None) -> None:
        assert len(set(self._free)) == len(self._free), "a slot is twice in the free list"
        assert len(self._free) + sum(self._is_used) == self.num_slots, "free + used != total slots"
        assert not any(self._is_used[s] for s in self._free), "a free slot is marked used"
        if holders is not None:
            held = list(holders)
            assert len(set(held)) == len(held), "two sequences hold the same slot"
            assert sorted(held) == [s for s in range(self.num_slots) if self._is_used[s]], "slot holders mismatch"
