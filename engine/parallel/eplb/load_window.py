"""Expert load statistics over a sliding window of steps."""

from __future__ import annotations

import numpy as np


class ExpertLoadWindow:
    """Tokens per (layer, logical expert) over the last ``window`` steps.

    A ring of per-step counts plus their running total: ``record`` costs one [layers, experts]
    add and subtract; ``total`` reads the window without summing it again. Counts are kept in
    float32 (exact for integers below 2**24; decode's 1000 steps x 43 layers x 256 experts is
    44 MB) and summed in float64, so the total never drifts from the ring.
    """

    def __init__(self, num_layers: int, num_logical: int, window: int):
        assert num_layers >= 1 and num_logical >= 1, "need at least one layer and one expert"
        assert window >= 1, f"window must be at least one step, got {window}"
        self.window = window
        self._ring = np.zeros((window, num_layers, num_logical), dtype=np.float32)  # step s at row s % window
        self._total = np.zeros((num_layers, num_logical))
        self.num_steps = 0  # steps recorded since the start

    @property
    def is_full(self) -> bool:
        return self.num_steps >= self.window

    def record(self, counts: np.ndarray) -> None:
        """One step's tokens. counts: [layers, num_logical], non-negative."""
        counts = np.asarray(counts, dtype=np.float64)
        assert counts.shape == self._total.shape, f"counts must be {self._total.shape}, got {counts.shape}"
        assert (counts >= 0).all() and np.isfinite(counts).all(), "token counts must be finite and non-negative"
        row = self.num_steps % self.window
        kept = counts.astype(np.float32)  # what the ring holds is what the total adds
        self._total += kept.astype(np.float64) - self._ring[row]
        self._ring[row] = kept
        self.num_steps += 1

    def total(self) -> np.ndarray:
        """[layers, num_logical]: tokens over the last min(num_steps, window) steps."""
        return np.maximum(self._total, 0.0)  # a copy; clips float round-off below zero

    def history(self) -> np.ndarray:
        """[min(num_steps, window), layers, num_logical]: the window's steps, oldest first."""
        if not self.is_full:
            return self._ring[: self.num_steps].copy()
        start = self.num_steps % self.window
        return np.concatenate([self._ring[start:], self._ring[:start]])
