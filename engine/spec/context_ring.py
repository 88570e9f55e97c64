"""The drafter's per-sequence context: the last ``window`` injected rows of each SWA slot.

    rows   [stages, num_slots, window, width]   row of position p at ring index p % window
    tags   [num_slots, window] int64            the position each ring row holds (-1: none)
    owner  [num_slots] int64                    seq_id whose rows the slot holds (-1: none)

Only positions whose tokens were accepted are ever written (rejected drafts' features are
dropped after verification), so a ring row is either a committed position's or stale. A read
for a proposal anchored at ``p`` takes every ring row and marks valid the ones tagged
``p - window + 1 .. p``: attention over a set of rows does not care about their order, and a
position never written (before a prefix hit, before a P/D handoff, after a bounded replay that
skipped it) is simply absent. Rollback needs nothing: a rejected position was never written,
and a position recomputed after preemption is written again with the same row. A slot handed to
another sequence is cleared at its first write (``owner``).
"""

from __future__ import annotations

import torch


class ContextRing:
    def __init__(self, *, num_stages: int, num_slots: int, window: int, width: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if num_stages < 1 or num_slots < 1 or window < 1 or width < 1:
            raise ValueError("a context ring needs >= 1 stage, slot, window position and width")
        self.window = window
        self.rows = torch.zeros(num_stages, num_slots, window, width, device=device, dtype=dtype)
        self.tags = torch.full((num_slots, window), -1, dtype=torch.int64, device=device)
        self.owner = torch.full((num_slots,), -1, dtype=torch.int64)  # host: checked per write

    @property
    def num_slots(self) -> int:
        return self.tags.shape[0]

    def claim(self, slot: int, seq_id: int) -> None:
        """Make ``seq_id`` the owner of ``slot``, forgetting another sequence's rows."""
        if int(self.owner[slot]) != seq_id:
            self.owner[slot] = seq_id
            self.tags[slot].fill_(-1)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """``rows [stages, n, width]`` of ``positions [n]`` into ``slots [n]`` (claimed first).
        Within one call a (slot, ring index) pair must appear once: keep the last ``window``
        positions of a sequence."""
        if positions.numel() == 0:
            return
        dev = self.tags.device
        slots, positions = slots.to(dev), positions.to(dev)
        index = positions % self.window
        self.rows[:, slots, index] = rows.to(self.rows.dtype)
        self.tags[slots, index] = positions

    def read(self, slots: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context of proposals anchored at ``anchors [N]`` in ``slots [N]``:
        (rows ``[stages, N, window, width]``, valid ``[N, window]``)."""
        dev = self.tags.device
        slots, anchors = slots.to(dev), anchors.to(dev)
        tags = self.tags.index_select(0, slots)
        low = (anchors - self.window + 1).unsqueeze(1)
        valid = (tags >= low) & (tags <= anchors.unsqueeze(1)) & (tags >= 0)
        return self.rows.index_select(1, slots), valid
