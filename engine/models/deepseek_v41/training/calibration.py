"""Calibration of the DSpark confidence head: expected calibration error and per-position temperatures.

ECE over ``bins`` equal-width confidence bins: ``sum_b (n_b / N) * |accuracy_b - confidence_b|``.
Sequential temperature scaling: position k's temperature ``T_k`` is chosen on a grid to minimise
the log loss of ``sigmoid(logit / T_k)`` on the events of position k (a draft whose earlier drafts
were all accepted), one position after the other. (Minimising the binned ECE itself overfits the
few events of the late positions: it moved the test ECE the wrong way in our runs.) Pure numpy.
"""

from __future__ import annotations

import numpy as np

TEMPERATURE_GRID = np.exp(np.linspace(np.log(0.2), np.log(10.0), 241))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60, 60)))


def ece(confidence: np.ndarray, outcome: np.ndarray, bins: int = 10) -> float:
    confidence, outcome = np.asarray(confidence, dtype=np.float64), np.asarray(outcome, dtype=np.float64)
    if not len(confidence):
        return float("nan")
    which = np.minimum((confidence * bins).astype(np.int64), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += sel.sum() * abs(outcome[sel].mean() - confidence[sel].mean())
    return float(total / len(confidence))


def log_loss(p: np.ndarray, outcome: np.ndarray) -> float:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-(outcome * np.log(p) + (1 - outcome) * np.log(1 - p)).mean())


def fit_temperature(logits: np.ndarray, outcome: np.ndarray) -> float:
    """The grid temperature with the lowest log loss; 1 without events."""
    if not len(logits):
        return 1.0
    losses = np.array([log_loss(sigmoid(logits / t), outcome) for t in TEMPERATURE_GRID])
    return float(TEMPERATURE_GRID[int(np.argmin(losses))])


def fit_temperatures(events: list[tuple[np.ndarray, np.ndarray]]) -> list[float]:
    """One temperature per draft position from its (logits, outcomes)."""
    return [fit_temperature(lg, out) for lg, out in events]
