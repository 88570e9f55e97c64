"""A smooth step-time model from noisy timings: one line ``t = a + b B`` per request count.

Calibration (sps_calibration.py) times each point ``(R, B)`` several times, the points of a
round in shuffled order, so a burst of load on a shared machine lands on random points instead
of on one end of the grid. This module turns those timings into the table's step times:

    per point    the median of its timings (a burst in a minority of rounds moves it not at all;
                 the fastest timing, kept before, swings with every lucky or unlucky run)
    per R        t(B) = a_R + b_R B fitted to the medians, a_R, b_R >= 0 (weights 1/t: relative
                 error, as the scheduler compares ratios); monotone and convex in B by form
    across R     the fitted step times at the grid's points get the padding envelope
                 t(R, L) = min over R' >= R, L' >= L (sps_calibration.padding_envelope)

Why a line: below the compute knee a step's time hardly moves with B, past it each verify token
costs about one token of compute; over the few depths the scheduler can choose (B = R .. R (1 + D))
one segment of that curve is a line, and the scheduler's choice depends on b_R / (a_R + drafter),
which a least-squares line over every depth estimates far more stably than any single point.
The spread ``(p75 - p25) / median`` per R says how noisy the calibration was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StepLine:
    """``t(B) = intercept + slope B`` seconds for one request count."""

    intercept: float
    slope: float
    spread: float  # median over the points of (p75 - p25) / median of their timings

    def __call__(self, num_tokens: float) -> float:
        return self.intercept + self.slope * num_tokens


def fit_line(points: Mapping[int, Sequence[float]]) -> StepLine:
    """``points``: B -> its timings (seconds). Non-negative relative-error least squares of the
    per-point medians; one point gives a flat line at its median."""
    if not points or any(len(ts) == 0 for ts in points.values()):
        raise ValueError("fitting a step line needs at least one timing per point")
    xs = np.array(sorted(points), dtype=np.float64)
    rows = [np.asarray(points[int(b)], dtype=np.float64) for b in xs]
    med = np.array([np.median(r) for r in rows])
    spread = float(np.median([(np.percentile(r, 75) - np.percentile(r, 25)) / m for r, m in zip(rows, med)]))
    if np.any(~np.isfinite(med)) or np.any(med <= 0):
        raise ValueError(f"step timings must be finite and > 0 seconds, got medians {med.tolist()}")
    if len(xs) == 1:
        return StepLine(float(med[0]), 0.0, spread)
    w = 1.0 / med
    a = np.stack([w, xs * w], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(a, med * w, rcond=None)
    if slope < 0:  # noise made more tokens look faster: flat at the weighted mean
        intercept, slope = float(np.sum(med * w * w) / np.sum(w * w)), 0.0
    elif intercept < 0:  # a line through the origin
        intercept, slope = 0.0, float(np.sum(xs * med * w * w) / np.sum(xs * xs * w * w))
    return StepLine(float(intercept), float(slope), spread)


def fit_step_table(timings: Mapping[int, Mapping[int, Sequence[float]]]) -> tuple[dict[int, dict[int, float]], dict[int, StepLine]]:
    """``timings[R][B]`` -> (fitted ``step_seconds[R][B]`` at the same points, the line per R)."""
    lines = {r: fit_line(row) for r, row in timings.items()}
    fitted = {r: {b: max(lines[r](b), 1e-9) for b in row} for r, row in timings.items()}
    return fitted, lines
