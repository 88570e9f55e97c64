"""Target steps per second as a function of the verify tokens in a step: ``SPS(B)``.

``B`` counts every token the target processes in one decode/verify step: for each running
request its root token (the last committed token, whose logits yield the token the target always
commits) plus the draft tokens verified for it. A step without speculation has ``B = R``.

The profile holds measured points ``(B, seconds per step)`` and interpolates *step time*
piecewise linearly between them (time, not its inverse, is what grows about linearly with tokens
once compute saturates). Below the first point the time is flat; past the last point it
extends the last segment's slope (the compute-bound regime is linear in tokens).

Measured times are noisy and may dip as ``B`` grows. The profile keeps the suffix minimum,
``t(B) = min over measured B' >= B of t(B')``: a step of ``B`` tokens can always be padded to
``B'`` tokens, so that time is achievable, and it makes ``t`` non-decreasing, i.e. SPS
non-increasing, which the length scheduler's early stop needs (length_schedule.py).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

# slopes within this relative tolerance count as equal when checking convexity (measurement
# tables written with rounded times would otherwise fail the check on exact-looking lines)
_CONVEX_RTOL = 1e-9


@dataclass(frozen=True, slots=True)
class SpsProfile:
    """Step time at measured verify-token counts; ``profile(B)`` gives steps per second."""

    num_tokens: tuple[int, ...]  # measured B, strictly increasing, >= 1
    seconds: tuple[float, ...]  # step time at each B after the suffix-min envelope, > 0
    _is_convex: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.num_tokens) != len(self.seconds) or not self.num_tokens:
            raise ValueError("an SPS profile needs at least one (tokens, seconds) point and equal-length columns")
        if any(b < 1 for b in self.num_tokens) or any(b >= c for b, c in zip(self.num_tokens, self.num_tokens[1:])):
            raise ValueError(f"SPS profile token counts must be >= 1 and strictly increasing, got {self.num_tokens}")
        if any(not (math.isfinite(t) and t > 0) for t in self.seconds):
            raise ValueError(f"SPS profile step times must be finite and > 0 seconds, got {self.seconds}")
        if any(t > u for t, u in zip(self.seconds, self.seconds[1:])):
            raise ValueError("SPS profile step times must be non-decreasing; build it with SpsProfile.from_points")
        xs, ts = self.num_tokens, self.seconds
        slopes = [(t1 - t0) / (x1 - x0) for x0, x1, t0, t1 in zip(xs, xs[1:], ts, ts[1:])]
        convex = all(b >= a - _CONVEX_RTOL * max(abs(a), abs(b)) for a, b in zip(slopes, slopes[1:]))
        object.__setattr__(self, "_is_convex", convex)  # frozen: computed once, read every step

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_points(cls, points: Iterable[tuple[int, float]]) -> SpsProfile:
        """From measured ``(B, seconds per step)`` pairs in any order (duplicates rejected)."""
        pts = sorted((int(b), float(t)) for b, t in points)
        if any(a[0] == b[0] for a, b in zip(pts, pts[1:])):
            raise ValueError("SPS profile has two measurements for the same token count; average them first")
        for b, t in pts:
            if b < 1 or not (math.isfinite(t) and t > 0):
                raise ValueError(f"bad SPS profile point ({b}, {t}): tokens must be >= 1 and seconds finite and > 0")
        seconds = [t for _, t in pts]
        for i in range(len(seconds) - 2, -1, -1):  # suffix minimum: padding to more tokens is allowed
            seconds[i] = min(seconds[i], seconds[i + 1])
        return cls(tuple(b for b, _ in pts), tuple(seconds))

    @classmethod
    def from_table(cls, table: Mapping[int, float]) -> SpsProfile:
        """From ``{B: seconds per step}``."""
        return cls.from_points(table.items())

    def shifted(self, seconds: float) -> SpsProfile:
        """The same profile with ``seconds`` added to every step (e.g. the drafter's pass, which
        costs the same whatever lengths are verified)."""
        if not (math.isfinite(seconds) and min(self.seconds) + seconds > 0):
            raise ValueError(f"shifting the SPS profile by {seconds} s leaves a step time <= 0")
        return SpsProfile(self.num_tokens, tuple(t + seconds for t in self.seconds))

    # ---- queries --------------------------------------------------------------------------
    def step_seconds(self, num_tokens: float) -> float:
        """Interpolated seconds per step at ``num_tokens`` verify tokens."""
        xs, ts = self.num_tokens, self.seconds
        if num_tokens <= xs[0] or len(xs) == 1:  # flat below the first point (and everywhere for one)
            return ts[0]
        i = bisect.bisect_right(xs, num_tokens) - 1
        if i >= len(xs) - 1:  # past the last point: extend the last segment
            i = len(xs) - 2
        x0, x1, t0, t1 = xs[i], xs[i + 1], ts[i], ts[i + 1]
        return t0 + (t1 - t0) * (num_tokens - x0) / (x1 - x0)

    def step_seconds_many(self, num_tokens) -> np.ndarray:
        """``step_seconds`` over an array of token counts (one numpy pass)."""
        x = np.asarray(num_tokens, dtype=np.float64)
        xs, ts = np.asarray(self.num_tokens, dtype=np.float64), np.asarray(self.seconds)
        out = np.interp(x, xs, ts)  # flat outside [xs[0], xs[-1]]
        if len(xs) > 1:  # past the last point: extend the last segment
            slope = (ts[-1] - ts[-2]) / (xs[-1] - xs[-2])
            out = np.where(x > xs[-1], ts[-1] + slope * (x - xs[-1]), out)
        return out

    def __call__(self, num_tokens: float) -> float:
        """Steps per second at ``num_tokens`` verify tokens (non-increasing in ``num_tokens``)."""
        return 1.0 / self.step_seconds(num_tokens)

    @property
    def is_step_time_convex(self) -> bool:
        """True when step time is convex in ``B`` over the whole line (flat start, segment slopes
        non-decreasing, linear tail). Then ``tokens x SPS`` is unimodal along the scheduler's
        candidate order and it may stop at the first decrease (length_schedule.py)."""
        return self._is_convex
