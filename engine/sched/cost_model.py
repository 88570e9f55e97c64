"""Quadratic step-time model used to size prefill chunks (ARCHITECTURE.md, "Balancers": the prefill balancer inside one GPU).

A sequence computing ``n`` new positions on top of ``p`` already computed ones costs about

    c_tok * n          (projections, MoE: linear in new tokens)
  + c_ctx * n * p      (attention of the new queries over the cached prefix)
  + c_sq  * n^2        (attention inside the chunk)
  + c_seq              (per-sequence overhead: metadata, sampling, a decode's fixed work)

and a step costs ``c0`` plus the sum over its sequences. The step time is therefore linear in the
step's feature vector ``[1, num_seqs, sum n, sum n*p, sum n^2]``: coefficients are fitted by
non-negative least squares (a negative attention term would let the model promise that longer
prefixes are free) over profiled start-up steps plus a bounded window of recent measured steps.
Rows are weighted by 1/t so the fit minimises *relative* error, which is what a time budget needs.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from deepinfer.engine.sched.types import StepFeatures

NUM_FEATURES = 5
FEATURE_NAMES = ("c0", "c_seq", "c_tok", "c_ctx", "c_sq")


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a handful of columns: best unconstrained solution
    over every subset of active columns whose solution is non-negative (2^5 tiny solves)."""
    num_cols = a.shape[1]
    best_x, best_err = np.zeros(num_cols), float(np.sum(b * b))
    for k in range(1, num_cols + 1):
        for cols in itertools.combinations(range(num_cols), k):
            sub = a[:, cols]
            x_sub, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x_sub < 0):
                continue
            err = float(np.sum((sub @ x_sub - b) ** 2))
            if err < best_err - 1e-18 * max(1.0, best_err):
                best_x = np.zeros(num_cols)
                best_x[list(cols)] = x_sub
                best_err = err
    return best_x


class CostModel:
    """Fitted ``t(step)``; ``observe`` measured steps, ``refit`` periodically, ``predict``."""

    def __init__(
        self,
        coefficients: Sequence[float] | None = None,
        *,
        window: int = 512,
        refit_every: int = 64,
        min_samples: int = 8,
    ) -> None:
        self.coef = np.asarray(coefficients if coefficients is not None else np.zeros(NUM_FEATURES), dtype=float)
        if self.coef.shape != (NUM_FEATURES,) or np.any(self.coef < 0):
            raise ValueError(f"cost model needs {NUM_FEATURES} non-negative coefficients {FEATURE_NAMES}")
        self._profiled: list[tuple[np.ndarray, float]] = []
        self._recent: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._num_since_fit = 0
        self.refit_every = refit_every
        self.min_samples = min_samples

    @property
    def is_fitted(self) -> bool:
        return bool(np.any(self.coef > 0))

    def predict(self, features: StepFeatures) -> float:
        return float(features.vector() @ self.coef)

    # ---- fitting ----------------------------------------------------------------------
    def add_profile(self, features: StepFeatures, seconds: float) -> None:
        """A start-up measurement: kept for good (it covers shapes online traffic may not)."""
        self._profiled.append((features.vector(), float(seconds)))

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """An online measurement: kept in a bounded window; refits every ``refit_every``."""
        if seconds <= 0 or not math.isfinite(seconds):
            return
        self._recent.append((features.vector(), float(seconds)))
        self._num_since_fit += 1
        if self._num_since_fit >= self.refit_every:
            self.refit()

    def refit(self) -> bool:
        samples = self._profiled + list(self._recent)
        self._num_since_fit = 0
        if len(samples) < self.min_samples:
            return False
        x = np.stack([s[0] for s in samples])
        t = np.array([s[1] for s in samples])
        self.coef = fit_coefficients(x, t)
        return True

    # ---- chunk sizing -----------------------------------------------------------------
    def max_chunk(self, base: StepFeatures, prefix: int, time_left: float, max_tokens: int) -> int:
        """Largest ``n <= max_tokens`` such that adding a chunk of ``n`` tokens over ``prefix``
        computed ones keeps the step's predicted time within ``time_left`` (0 if none fits).

        predicted(base + chunk) = predicted(base) + c_seq + (c_tok + c_ctx*p) * n + c_sq * n^2
        """
        c0, c_seq, c_tok, c_ctx, c_sq = self.coef
        slack = time_left - self.predict(base) - c_seq
        lin = c_tok + c_ctx * prefix
        if slack <= 0:
            return 0
        if c_sq > 0:
            n = (-lin + math.sqrt(lin * lin + 4.0 * c_sq * slack)) / (2.0 * c_sq)
        elif lin > 0:
            n = slack / lin
        else:
            return max_tokens
        return max(0, min(max_tokens, int(math.floor(n + 1e-9))))


def fit_coefficients(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Relative-error NNLS: minimise sum(((x @ c) - t) / t)^2 subject to c >= 0.

    Columns are rescaled to unit norm first: their magnitudes differ by many orders (1 vs n*p)."""
    w = 1.0 / np.maximum(t, 1e-12)
    a = x * w[:, None]
    b = t * w
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    return nnls(a / scale, b) / scale
