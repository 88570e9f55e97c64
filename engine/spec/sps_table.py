"""Target steps per second by batch size: one ``SpsProfile`` per number of decoding requests.

The length scheduler needs ``SPS(B)`` for the step at hand, and the same B costs differently
spread over 4 requests or over 60 (per-sequence work, attention over each one's context). The
table holds measured step times at a grid of request counts ``R`` and verify tokens ``B``
(``R x (1 + L)`` for a few draft depths L), plus the drafter's pass per R (paid once a step,
whatever is verified). ``profile(R)`` is the profile the scheduler uses for a step of R requests:

    R on the grid     its measured points, shifted by the drafter's time at R
    R between R0, R1  t(B) = (1 - w) t0(B R0 / R) + w t1(B R1 / R),  w = (R - R0) / (R1 - R0):
                      the same tokens per request at both neighbours, linear in R
    R outside         the nearest two grid points extended the same way (never below the
                      smallest measured time)

evaluated at B = R (1 + j), j = 0 .. max depth. ``profile(R, drafter=False)`` leaves the
drafter's time out: a step after which nobody drafts (decoding.py's drafter gate). Profiles are
cached per R. ``draft_threads[R]``: the intra-op thread count the drafter's time at R was
measured with (the faster of torch's count and 1; the proposer runs its passes so).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from deepinfer.engine.spec.sps_profile import SpsProfile


class SpsTable:
    def __init__(self, step_seconds: Mapping[int, Mapping[int, float]], draft_seconds: Mapping[int, float],
                 *, max_depth: int, device: str = "", draft_threads: Mapping[int, int] | None = None) -> None:
        """``step_seconds[R][B]``: measured target step time of R requests verifying B tokens in
        all; ``draft_seconds[R]``: the drafter's pass for R requests (same grid), run with
        ``draft_threads[R]`` intra-op threads (absent: torch's count)."""
        if not step_seconds or set(step_seconds) != set(draft_seconds):
            raise ValueError("an SPS table needs step and drafter times at the same request counts")
        if max_depth < 0:
            raise ValueError(f"max draft depth must be >= 0, got {max_depth}")
        self.grid = tuple(sorted(int(r) for r in step_seconds))
        if self.grid[0] < 1:
            raise ValueError(f"request counts must be >= 1, got {self.grid}")
        self.step_seconds = {int(r): {int(b): float(t) for b, t in step_seconds[r].items()} for r in self.grid}
        self.draft_seconds = {int(r): float(draft_seconds[r]) for r in self.grid}
        self._measured = {r: SpsProfile.from_table(self.step_seconds[r]) for r in self.grid}
        if any(not (math.isfinite(t) and t >= 0) for t in self.draft_seconds.values()):
            raise ValueError("drafter times must be finite and >= 0 seconds")
        if draft_threads is not None and (set(draft_threads) != set(self.grid) or min(draft_threads.values()) < 1):
            raise ValueError("drafter thread counts must be >= 1 and given at the table's request counts")
        self.draft_threads = {int(r): int(n) for r, n in draft_threads.items()} if draft_threads is not None else None
        self.max_depth = max_depth
        self.device = device
        self._cache: dict[tuple[int, bool], SpsProfile] = {}

    def profile(self, num_requests: int, *, drafter: bool = True) -> SpsProfile:
        """``SPS(B)`` for a step of ``num_requests`` requests, the drafter's pass included unless
        ``drafter`` is False."""
        if num_requests < 1:
            raise ValueError(f"a step profile needs >= 1 request, got {num_requests}")
        key = (num_requests, drafter)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._build(num_requests, drafter)
        return found

    def target_seconds(self, num_requests: int, num_tokens: float) -> float:
        """The target's step time alone (no drafter) at ``num_tokens`` verify tokens."""
        return self._interpolate(num_requests, num_tokens, lambda r, b: self._measured[r].step_seconds(b))

    def draft_time(self, num_requests: int) -> float:
        return max(0.0, self._interpolate(num_requests, 0.0, lambda r, b: self.draft_seconds[r]))

    def _neighbours(self, num_requests: int) -> tuple[int, int, float]:
        grid = self.grid
        if len(grid) == 1:
            return grid[0], grid[0], 0.0
        hi = next((i for i, r in enumerate(grid) if r >= num_requests), len(grid) - 1)
        hi = max(hi, 1)
        r0, r1 = grid[hi - 1], grid[hi]
        return r0, r1, (num_requests - r0) / (r1 - r0)

    def _interpolate(self, num_requests: int, num_tokens: float, at) -> float:
        r0, r1, w = self._neighbours(num_requests)
        share = num_tokens / num_requests
        return (1.0 - w) * at(r0, share * r0) + w * at(r1, share * r1)

    def _build(self, num_requests: int, drafter: bool) -> SpsProfile:
        floor = min(min(p.seconds) for p in self._measured.values())
        draft = self.draft_time(num_requests) if drafter else 0.0
        points = {}
        for depth in range(self.max_depth + 1):
            b = num_requests * (1 + depth)
            points[b] = max(self.target_seconds(num_requests, b), floor) + draft
        return SpsProfile.from_table(points)

    # ---- files -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = {"device": self.device, "max_depth": self.max_depth,
                "step_seconds": {str(r): {str(b): t for b, t in row.items()} for r, row in self.step_seconds.items()},
                "draft_seconds": {str(r): t for r, t in self.draft_seconds.items()}}
        if self.draft_threads is not None:
            data["draft_threads"] = {str(r): n for r, n in self.draft_threads.items()}
        return data

    @classmethod
    def from_json(cls, data: Mapping) -> SpsTable:
        try:
            steps = {int(r): {int(b): float(t) for b, t in row.items()} for r, row in data["step_seconds"].items()}
            drafts = {int(r): float(t) for r, t in data["draft_seconds"].items()}
            threads = data.get("draft_threads")
            threads = {int(r): int(n) for r, n in threads.items()} if threads is not None else None
            return cls(steps, drafts, max_depth=int(data["max_depth"]), device=str(data.get("device", "")),
                       draft_threads=threads)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not an SPS table ({type(e).__name__}: {e})") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> SpsTable:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read an SPS table ({e})") from None
        return cls.from_json(data)


def table_from_cost_model(cost_model, grid: Sequence[int], *, context: int, max_depth: int,
                          draft_seconds: Mapping[int, float]) -> SpsTable:
    """An SPS table from the fitted step-time model of engine/sched/cost_model.py instead of a
    calibration: R sequences at ``context`` computed positions, each verifying 1 + L tokens."""
    from deepinfer.engine.sched.types import StepFeatures

    steps = {}
    for r in grid:
        row = {}
        for depth in range(max_depth + 1):
            n = 1 + depth
            row[r * n] = max(cost_model.predict(StepFeatures.of([(n, context)] * r)), 1e-6)
        steps[r] = row
    return SpsTable(steps, draft_seconds, max_depth=max_depth)
