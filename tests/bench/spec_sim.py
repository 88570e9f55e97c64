"""Simulated speculative decoding: the verify-length policies' economics without a model.

A simulated drafter proposes ``D`` drafts per request per step. Its acceptance follows a given
per-position curve, and its confidence head is calibrated by construction:

    z      ~ N(0, context_spread)                   per (request, step): how easy this context is;
                                                    shared by the block's positions, seen by the head
    m_j    = sigmoid(logit(curve[j]) + z)           prior mean acceptance of draft j in this context
    p_j    ~ Beta(m_j k, (1 - m_j) k)               true P(draft j accepted | drafts < j accepted)
    s_j    ~ Binomial(num_signals, p_j)             what the head learns of p_j beyond the context
    c_j    = (m_j k + s_j) / (k + num_signals)      the head's confidence: the posterior mean of p_j
    accept_j = u_j < p_j, u ~ U(0, 1); accepted drafts = the leading run of accepts, capped at L

Since ``c_j`` is the posterior mean of ``p_j`` given what the head saw, ``P(accept_j | c_j) = c_j``
exactly, and ``a = cumprod(c)`` is the calibrated prefix survival (positions are independent
given the context). ``num_signals`` sets how sharp the head is (0: it knows only the context).

The target's step time ``t(B)`` is a smooth roofline: flat at ``floor_s`` while the batch's
``B`` verify tokens leave compute idle, then ``per_token_s`` per token past ``knee`` (a hyperbola
of width ``knee_width`` joins the two). The drafter's pass costs ``draft_fraction`` of a target
step over its ``D x R`` block tokens (3 stages of a 40-layer target: 3/40) and is paid whenever
speculation is on, whatever lengths are verified. ``StepTimeModel.fit_deepseek`` fits
``floor_s`` and ``per_token_s`` so that DeepSeek's two published operating points at 60
sequences per rank lie on the curve (see its docstring).

Policies: ``off`` (no drafter: B = R, 1 token per request), ``fixed`` (verify all D),
``confidence`` (the exact schedule every step) and ``delayed`` (budget sized from the
confidences two steps old, filled with the current top candidates). All four see the same random
draws (common random numbers), so their differences are not sampling noise of separate runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from deepinfer.engine.spec import FixedPolicy, SpsProfile, make_length_policy

POLICIES = ("off", "fixed", "confidence", "delayed")
# DeepSeek's DSpark figures at 60 sequences per rank, EP64/DP64 (ARCHITECTURE.md, "DSpark")
DEEPSEEK_CONCURRENCY = 60
DEEPSEEK_TOK_S_FIXED, DEEPSEEK_TOK_S_SCHED = 13_730.0, 14_466.0
DEEPSEEK_ACCEPTED_FIXED, DEEPSEEK_ACCEPTED_SCHED = 3.29, 3.20
DEEPSEEK_VERIFIED_SCHED = 3.5  # "5.00 -> 3.2-4.4, about 30 % fewer": the 30 % reading


@dataclass(frozen=True, slots=True)
class AcceptanceModel:
    # mean conditional acceptance per position before the context shift; with the defaults below the
    # marginal prefix survival is 0.75, 0.56, 0.42, 0.32, 0.25 and fixed-5 commits 3.29 tokens per
    # request per step, the accepted length DeepSeek reports for fixed-5 verification
    curve: tuple[float, ...] = (0.80, 0.74, 0.69, 0.65, 0.61)
    context_spread: float = 1.2  # sd of the context's logit shift z
    concentration: float = 3.0  # k: how far the true p_j strays from the context's mean
    num_signals: int = 6  # the head's extra information about p_j

    @property
    def num_drafts(self) -> int:
        return len(self.curve)

    def draw(self, rng: np.random.Generator, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For ``shape = (steps, requests)``: confidences c, leading-accept run lengths (0..D,
        the drafts that would be accepted if all were verified), and per-draft true p."""
        curve = np.asarray(self.curve)
        logit = np.log(curve / (1 - curve))
        z = rng.normal(0.0, self.context_spread, size=(*shape, 1))
        mean = 1 / (1 + np.exp(-(logit + z)))
        k = self.concentration
        p = rng.beta(mean * k, (1 - mean) * k)
        signals = rng.binomial(self.num_signals, p)
        conf = (mean * k + signals) / (k + self.num_signals)
        accepted = rng.random(p.shape) < p
        run = np.cumprod(accepted, axis=-1).sum(axis=-1)
        return conf, run, p


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    floor_s: float  # step time while compute is idle
    per_token_s: float  # marginal step time per verify token once compute saturates
    knee: float = 128.0  # verify tokens where compute saturates
    knee_width: float = 64.0
    draft_fraction: float = 3 / 40  # drafter pass = this x a target step over its D x R tokens

    def target_s(self, num_tokens):
        x = np.asarray(num_tokens, dtype=np.float64) - self.knee
        return self.floor_s + self.per_token_s * (x + np.sqrt(x * x + self.knee_width**2)) / 2

    def draft_s(self, num_requests: int, num_drafts: int) -> float:
        return self.draft_fraction * float(self.target_s(num_requests * num_drafts)) if num_drafts else 0.0

    def profile(self, max_tokens: int) -> SpsProfile:
        """What start-up profiling would measure: the target step at a grid of token counts."""
        grid = sorted({1, 8, 16, *range(32, max(max_tokens, 64) + 32, 32)})
        return SpsProfile.from_points((b, float(self.target_s(b))) for b in grid)

    @classmethod
    def fit_deepseek(cls, num_drafts: int = 5, **shape) -> StepTimeModel:
        """``floor_s`` and ``per_token_s`` from DeepSeek's operating points at R = 60: fixed-5
        commits 3.29 tokens per request per step at 13,730 tok/s, so one step (target at
        B = 60 x 6 = 360, plus the drafter) takes 60 x 3.29 / 13,730 = 14.38 ms; the schedule
        commits 3.20 at 14,466 tok/s, 13.27 ms per step, at B = 60 x (1 + 3.5) = 270 (3.5 drafts
        verified per request: the 30 % cut). Two equations, linear in the two unknowns. The knee
        and its width are assumptions (nothing published pins them)."""
        base = cls(1.0, 1.0, **shape)
        r = DEEPSEEK_CONCURRENCY
        rows, rhs = [], []
        for verified, tok_s, accepted in ((num_drafts, DEEPSEEK_TOK_S_FIXED, DEEPSEEK_ACCEPTED_FIXED),
                                          (DEEPSEEK_VERIFIED_SCHED, DEEPSEEK_TOK_S_SCHED, DEEPSEEK_ACCEPTED_SCHED)):
            step_s = r * accepted / tok_s
            h_target = _hinge(base, r * (1 + verified))
            h_draft = _hinge(base, r * num_drafts)
            # step = (floor + per_token h_target) + draft_fraction (floor + per_token h_draft)
            rows.append([1 + base.draft_fraction, h_target + base.draft_fraction * h_draft])
            rhs.append(step_s)
        floor_s, per_token_s = np.linalg.solve(np.array(rows), np.array(rhs))
        return cls(float(floor_s), float(per_token_s), **shape)


def _hinge(model: StepTimeModel, num_tokens: float) -> float:
    x = num_tokens - model.knee
    return (x + math.sqrt(x * x + model.knee_width**2)) / 2


@dataclass(slots=True)
class PolicyResult:
    num_steps: int = 0
    num_requests: int = 0  # request-steps
    verified: int = 0  # drafts sent to the target
    committed: int = 0  # tokens committed (accepted drafts + the target's own token)
    expected: float = 0.0  # what the schedule expected to commit
    seconds: float = 0.0  # simulated device time
    policy_s: float = 0.0  # host wall time spent in the policy
    verify_tokens: list[int] = field(default_factory=list)

    @property
    def verified_per_step(self) -> float:
        """Drafts verified per request per step (fixed: D)."""
        return self.verified / self.num_requests

    @property
    def accepted_len(self) -> float:
        """Tokens committed per request per step, the target's own token included (off: 1)."""
        return self.committed / self.num_requests

    @property
    def tok_s(self) -> float:
        return self.committed / self.seconds

    @property
    def policy_us(self) -> float:
        return 1e6 * self.policy_s / max(self.num_steps, 1)


def simulate(
    concurrency: int,
    num_steps: int,
    acceptance: AcceptanceModel,
    timing: StepTimeModel,
    *,
    seed: int = 0,
    max_verify_tokens: int | None = None,
) -> dict[str, PolicyResult]:
    """Run every policy for ``num_steps`` steps of ``concurrency`` requests (a full batch: a
    finished request is replaced at once) on the same draws; returns policy -> result."""
    rng = np.random.default_rng(seed)
    num_drafts = acceptance.num_drafts
    conf, run, _ = acceptance.draw(rng, (num_steps, concurrency))
    draft_s = timing.draft_s(concurrency, num_drafts)
    profile = timing.profile(concurrency * (1 + num_drafts)).shifted(draft_s)
    policies = {
        "fixed": FixedPolicy(profile),
        # the engine's default policy (its accepted-length floor included), exact and delayed
        "confidence": make_length_policy("confidence", profile, max_verify_tokens=max_verify_tokens),
        "delayed": make_length_policy("confidence", profile, delay=2, max_verify_tokens=max_verify_tokens),
    }
    results = {name: PolicyResult() for name in POLICIES}
    off = results["off"]
    off.num_steps, off.num_requests = num_steps, num_steps * concurrency
    off.committed = off.num_requests
    off.expected = float(off.num_requests)
    off.seconds = num_steps * float(timing.target_s(concurrency))
    off.verify_tokens = [concurrency] * num_steps
    for name, policy in policies.items():
        res = results[name]
        for step in range(num_steps):
            start = time.perf_counter()
            sched = policy(conf[step])
            res.policy_s += time.perf_counter() - start
            res.num_steps += 1
            res.num_requests += concurrency
            res.verified += int(sched.lengths.sum())
            res.committed += int(np.minimum(run[step], sched.lengths).sum()) + concurrency
            res.expected += sched.expected_tokens
            res.seconds += float(timing.target_s(sched.num_verify_tokens)) + draft_s
            res.verify_tokens.append(sched.num_verify_tokens)
    return results
