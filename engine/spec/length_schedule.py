"""DSpark's hardware-aware prefix scheduler: how many draft tokens to verify per request.

Inputs, for the ``R`` requests of one decode step and ``D`` drafts each (D = 5 in production):

    confidences  c  [R, D]  c[r, j] = P(draft j of r survives | drafts 0..j-1 survived), in [0, 1]
    survival     a  [R, D]  a[r, j] = prod_{i <= j} c[r, i] = P(drafts 0..j of r all survive)
    sps          SPS(B) -> target steps per second at B verify tokens (SpsProfile or a callable)

(0-based here: ``a[r, j]`` is the paper's depth j + 1.) Output: verify lengths ``L [R]`` in
``0..D``; request r sends its root token and drafts ``0..L[r]-1`` to the target. Then

    B = sum_r (1 + L[r])                          verify tokens: each root token plus its drafts
    E = sum_r (1 + sum_{j < L[r]} a[r, j])        expected committed tokens

The 1 in ``E`` is the token the target always yields per request: the correction at the first
rejected draft, or the bonus token after the last accepted one (so a request with ``L = 0`` is a
plain decode). Accepted drafts are a prefix, hence ``E[accepted] = sum a``. The scheduler
maximises ``E x SPS(B)``, the expected committed tokens per second.

Why a global sort is exact: ``a[r, j]`` is non-increasing in ``j`` (each ``c <= 1``), so for a
fixed ``B`` the ``B - R`` largest survivals across the batch form a prefix of every request (ties
broken by depth), and no prefix-closed choice of that size has a larger ``E``. Sorting all
candidates once and taking prefix sums gives the best ``E(K)`` for every draft count
``K = B - R``; the scheduler scans ``K = 0, 1, ...`` and keeps the best ``f(K) = E(K) x SPS(R+K)``
(ties keep the smaller ``K``).

Early stop, lossless:
  * bound rule (needs only SPS non-increasing, which SpsProfile guarantees): for every
    ``K' >= K``, ``f(K') <= E_max x SPS(R+K)``, with ``E_max`` the expected tokens with every
    allowed candidate. Once that is no more than the best ``f`` so far, nothing later beats it.
  * first-decrease rule (only when step time ``t = 1/SPS`` is convex in ``B``,
    ``SpsProfile.is_step_time_convex``): ``E(K)`` is concave (sorted gains shrink) and ``t(R+K)``
    convex, so for any ``alpha >= 0`` the sequence ``E(K) - alpha t(R+K)`` is concave. Take
    ``alpha = f(K)``: it is 0 at ``K``; if ``f(K+1) < f(K)`` it is negative at ``K+1``, so its
    increments are negative from there on and ``f(K') < f(K)`` for every ``K' > K``.
  SPS non-increasing alone does NOT make the first decrease final: with a flat SPS that drops
  by half at one B, f dips at the drop and then climbs past its old best on the next plateau
  (tests/engine/test_spec_schedule.py has that case). ``schedule_exhaustive`` enumerates every
  length vector and is the oracle in tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from deepinfer.engine.spec.sps_profile import SpsProfile

StepsPerSecond = Callable[[int], float]
# schedule_exhaustive enumerates (D + 1)^R length vectors; beyond this it is not a test oracle
MAX_EXHAUSTIVE = 200_000


@dataclass(frozen=True, slots=True)
class Schedule:
    """One step's verify plan."""

    lengths: np.ndarray  # [R] int64: drafts verified per request, 0..D
    num_verify_tokens: int  # B = R + sum(lengths)
    expected_tokens: float  # E: expected committed tokens (confidences taken as calibrated)
    steps_per_s: float  # SPS(B); 0.0 for an empty batch

    @property
    def num_draft_tokens(self) -> int:
        return int(self.num_verify_tokens - len(self.lengths))

    @property
    def expected_tokens_per_s(self) -> float:
        """The objective ``E x SPS(B)``."""
        return self.expected_tokens * self.steps_per_s


def check_confidences(confidences) -> np.ndarray:
    """``confidences`` as a float64 [R, D] array in [0, 1], or a one-line ValueError."""
    conf = np.asarray(confidences, dtype=np.float64)
    if conf.ndim != 2:
        raise ValueError(f"confidences must be a [requests, drafts] array, got shape {conf.shape}")
    if conf.size and not (np.all(np.isfinite(conf)) and conf.min() >= 0.0 and conf.max() <= 1.0):
        raise ValueError("confidences must be probabilities in [0, 1] (no NaN or inf)")
    return conf


def survival(confidences) -> np.ndarray:
    """``a [R, D]``: running product of the per-draft confidences along each request."""
    return np.cumprod(check_confidences(confidences), axis=1)


def expected_tokens(surv: np.ndarray, lengths) -> float:
    """``E = sum_r (1 + sum_{j < L[r]} a[r, j])`` for survivals ``a [R, D]`` and lengths ``L [R]``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    num_requests, num_drafts = surv.shape
    prefix = np.zeros((num_requests, num_drafts + 1))
    np.cumsum(surv, axis=1, out=prefix[:, 1:])
    return float(num_requests + prefix[np.arange(num_requests), lengths].sum())


def _depth_limits(num_requests: int, num_drafts: int, max_lengths) -> np.ndarray:
    """Per-request cap on L (a request one token from its limit can commit at most one more)."""
    if max_lengths is None:
        return np.full(num_requests, num_drafts, dtype=np.int64)
    caps = np.asarray(max_lengths, dtype=np.int64)
    if caps.shape != (num_requests,) or (num_requests and caps.min() < 0):
        raise ValueError(f"max_lengths must be {num_requests} non-negative ints, got {np.asarray(max_lengths).tolist()}")
    return np.minimum(caps, num_drafts)


def _draft_cap(num_requests: int, max_verify_tokens: int | None) -> int | None:
    if max_verify_tokens is None:
        return None
    if max_verify_tokens < num_requests:
        raise ValueError(f"max_verify_tokens {max_verify_tokens} is below the {num_requests} root tokens of the batch")
    return max_verify_tokens - num_requests


def _make(surv: np.ndarray, lengths: np.ndarray, sps: StepsPerSecond) -> Schedule:
    num_verify = int(len(lengths) + lengths.sum())
    rate = float(sps(num_verify)) if len(lengths) else 0.0
    return Schedule(lengths, num_verify, expected_tokens(surv, lengths), rate)


def _ranked_candidates(surv: np.ndarray, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Allowed candidates (r, j) in global order: survival descending, then depth, then request.
    Returns (request of each candidate, survival of each candidate)."""
    num_requests, num_drafts = surv.shape
    req = np.repeat(np.arange(num_requests), num_drafts)
    depth = np.tile(np.arange(num_drafts), num_requests)
    gain = surv.reshape(-1)
    keep = depth < caps[req]
    req, depth, gain = req[keep], depth[keep], gain[keep]
    order = np.lexsort((req, depth, -gain))  # last key is the primary one
    return req[order], gain[order]


def _rates(sps: StepsPerSecond, num_requests: int, num_max: int) -> Callable[[int], float]:
    """``k -> SPS(R + k)``; a profile is evaluated for every k in one numpy pass (a table lookup
    per k in Python would cost more than the whole scan), any other callable lazily."""
    if isinstance(sps, SpsProfile):
        table = (1.0 / sps.step_seconds_many(num_requests + np.arange(num_max + 1))).tolist()
        return table.__getitem__
    return lambda k: float(sps(num_requests + k))


def schedule_lengths(
    confidences,
    sps: StepsPerSecond,
    *,
    max_lengths=None,
    max_verify_tokens: int | None = None,
    early_stop: bool = True,
    min_share: float = 0.0,
) -> Schedule:
    """The confidence schedule: verify lengths maximising ``E x SPS(B)``.

    ``confidences [R, D]``; ``max_lengths [R]`` optional per-request caps on L;
    ``max_verify_tokens`` optional cap on B (it must leave room for the R root tokens);
    ``min_share``: only draft counts whose E is at least this share of E with every allowed
    candidate (the default "confidence" policy: a floor on the expected accepted length).
    ``early_stop`` applies the lossless stop rules of the module docstring; they assume SPS is
    non-increasing in B (true of SpsProfile). With another callable that may rise, pass False.
    """
    surv = survival(confidences)
    num_requests, num_drafts = surv.shape
    caps = _depth_limits(num_requests, num_drafts, max_lengths)
    draft_cap = _draft_cap(num_requests, max_verify_tokens)
    if num_requests == 0:
        return Schedule(np.zeros(0, dtype=np.int64), 0, 0.0, 0.0)
    # Step 1: every allowed candidate in global order, and E(K) for every draft count K
    req, gain = _ranked_candidates(surv, caps)
    num_max = len(gain) if draft_cap is None else min(len(gain), draft_cap)
    expected = num_requests + np.concatenate(([0.0], np.cumsum(gain[:num_max])))  # E(0..num_max)
    expected_max = float(expected[-1])
    unimodal = early_stop and isinstance(sps, SpsProfile) and sps.is_step_time_convex
    if not 0.0 <= min_share <= 1.0:
        raise ValueError(f"min_share must lie in [0, 1], got {min_share}")
    # the smallest K meeting the floor (E(K) is non-decreasing); the scan starts there
    first_k = int(np.searchsorted(expected, min_share * expected_max * (1 - 1e-12))) if min_share else 0
    # Step 2: scan K = first_k, first_k + 1, ..., keeping the first best f(K) = E(K) x SPS(R + K)
    rates = _rates(sps, num_requests, num_max)
    best_k, best_f = first_k, float(expected[first_k]) * rates(first_k)
    prev_f = best_f
    for k in range(first_k + 1, num_max + 1):
        rate = rates(k)
        if early_stop and expected_max * rate <= best_f:
            break  # bound rule: no later K can beat best_f
        f = float(expected[k]) * rate
        if f > best_f:
            best_k, best_f = k, f
        elif unimodal and f < prev_f:
            break  # first-decrease rule: f is unimodal when step time is convex
        prev_f = f
    # Step 3: the first best_k candidates are a prefix of each request: count them per request
    lengths = np.bincount(req[:best_k], minlength=num_requests).astype(np.int64)
    return _make(surv, lengths, sps)


def schedule_exhaustive(
    confidences,
    sps: StepsPerSecond,
    *,
    max_lengths=None,
    max_verify_tokens: int | None = None,
) -> Schedule:
    """Test oracle: try every length vector in ``prod_r 0..cap[r]`` (no sort, no early stop)."""
    surv = survival(confidences)
    num_requests, num_drafts = surv.shape
    caps = _depth_limits(num_requests, num_drafts, max_lengths)
    draft_cap = _draft_cap(num_requests, max_verify_tokens)
    if num_requests == 0:
        return Schedule(np.zeros(0, dtype=np.int64), 0, 0.0, 0.0)
    if float(np.prod(caps + 1.0)) > MAX_EXHAUSTIVE:
        raise ValueError(f"exhaustive schedule of {num_requests} requests x {num_drafts} drafts is too large; use schedule_lengths")
    best, best_f = None, -1.0
    for combo in itertools.product(*(range(int(c) + 1) for c in caps)):
        lengths = np.array(combo, dtype=np.int64)
        if draft_cap is not None and lengths.sum() > draft_cap:
            continue
        cand = _make(surv, lengths, sps)
        if cand.expected_tokens_per_s > best_f:
            best, best_f = cand, cand.expected_tokens_per_s
    return best


def schedule_fixed(confidences, sps: StepsPerSecond, *, num_drafts: int | None = None, max_lengths=None) -> Schedule:
    """The ``fixed`` policy: every request verifies ``num_drafts`` drafts (default all D),
    capped by ``max_lengths``. Reports the same E and SPS as the confidence schedule would."""
    surv = survival(confidences)
    num_requests, width = surv.shape
    depth = width if num_drafts is None else num_drafts
    if not 0 <= depth <= width:
        raise ValueError(f"fixed schedule of {depth} drafts needs 0..{width} (the drafts available)")
    caps = _depth_limits(num_requests, width, max_lengths)
    return _make(surv, np.minimum(caps, depth).astype(np.int64), sps)


def fill_budget(confidences, sps: StepsPerSecond, num_draft_tokens: int, *, max_lengths=None) -> Schedule:
    """Verify the ``num_draft_tokens`` candidates of highest survival (fewer if fewer are allowed):
    the best E for that budget. The production variant sizes the budget ahead (length_policy.py)."""
    if num_draft_tokens < 0:
        raise ValueError(f"draft-token budget must be >= 0, got {num_draft_tokens}")
    surv = survival(confidences)
    num_requests, num_drafts = surv.shape
    if num_requests == 0:
        return Schedule(np.zeros(0, dtype=np.int64), 0, 0.0, 0.0)
    req, _ = _ranked_candidates(surv, _depth_limits(num_requests, num_drafts, max_lengths))
    lengths = np.bincount(req[:num_draft_tokens], minlength=num_requests).astype(np.int64)
    return _make(surv, lengths, sps)
