"""The verify-length policies an engine holds (``--spec-schedule``): ``confidence`` (the default,
with the production variant that sizes the budget two steps ahead), ``throughput`` and ``fixed``.

``confidence`` is the length schedule (length_schedule.py: maximise expected committed tokens x
SPS(B)) restricted to draft counts whose expected committed tokens are at least
``ACCEPTED_FLOOR`` of verifying every draft: a floor on the accepted length. This is the trade
DeepSeek reports for production (about 30 % fewer tokens verified, accepted length almost
unchanged), and it drafts every step.

``throughput`` is the same schedule without the floor, plus the drafter gate (decoding.py): it
maximises tokens per second on the fitted SPS lines alone. Where a verify token costs about as
much as a decode token (a compute-bound CPU with 16 or more sequences) that optimum is to stop
speculating, and it does, giving up the accepted length; on memory-bound GPU steps the two
schedules choose almost alike.

Why the delay: with asynchronous scheduling the host prepares step ``s`` while the device runs
step ``s - 1``, so when step ``s``'s verify batch must be laid out (buffer sizes, captured graph,
expert-parallel dispatch sizes agreed across ranks), the newest confidences on the host are those
of step ``s - 2``. The production variant therefore sizes the draft budget from the
confidences ``delay`` steps old and fills it, on the device and without a host round trip, with
the *current* step's top candidates (``fill_budget``: the best E for that budget).

    step s - 2: confidences c[s-2] reach the host -> K* = draft count the exact schedule picks
    step s:     budget K = K* x R[s] / R[s-2] (same draft share per request; rounded)
                lengths = fill_budget(c[s], K): the K candidates of highest current survival

Until ``delay`` steps of history exist the budget comes from the current confidences (the
exact schedule). Policies are pure: plain arrays in, a ``Schedule`` out; the delayed one keeps a
short deque of past budgets, nothing else.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from deepinfer.engine.spec.length_schedule import (
    Schedule,
    StepsPerSecond,
    check_confidences,
    fill_budget,
    schedule_fixed,
    schedule_lengths,
)

SCHEDULES = ("confidence", "throughput", "fixed")  # the engine option --spec-schedule, default first
ACCEPTED_FLOOR = 0.95  # "confidence": E at least this share of E with every draft verified


class LengthPolicy(Protocol):
    def __call__(self, confidences, max_lengths=None) -> Schedule: ...


class FixedPolicy:
    """Always verify ``num_drafts`` drafts per request (all of them by default)."""

    def __init__(self, sps: StepsPerSecond, num_drafts: int | None = None) -> None:
        self.sps, self.num_drafts = sps, num_drafts

    def __call__(self, confidences, max_lengths=None) -> Schedule:
        return schedule_fixed(confidences, self.sps, num_drafts=self.num_drafts, max_lengths=max_lengths)


class ConfidencePolicy:
    """The hardware-aware prefix schedule; ``delay=0`` exact per step, ``delay=2`` production."""

    def __init__(self, sps: StepsPerSecond, *, delay: int = 0, max_verify_tokens: int | None = None,
                 min_share: float = 0.0) -> None:
        if delay < 0:
            raise ValueError(f"budget delay must be >= 0 steps, got {delay}")
        self.sps, self.delay, self.max_verify_tokens = sps, delay, max_verify_tokens
        self.min_share = min_share
        # (draft budget chosen, requests it was chosen for), oldest first
        self._history: deque[tuple[int, int]] = deque(maxlen=delay + 1)

    def __call__(self, confidences, max_lengths=None) -> Schedule:
        conf = check_confidences(confidences)
        exact = schedule_lengths(conf, self.sps, max_lengths=max_lengths, max_verify_tokens=self.max_verify_tokens,
                                 min_share=self.min_share)
        self._history.append((exact.num_draft_tokens, len(exact.lengths)))
        if self.delay == 0 or len(self._history) <= self.delay:
            return exact
        old_budget, old_requests = self._history[0]
        num_requests = conf.shape[0]
        budget = round(old_budget * num_requests / old_requests) if old_requests else exact.num_draft_tokens
        if self.max_verify_tokens is not None:
            budget = min(budget, self.max_verify_tokens - num_requests)
        return fill_budget(conf, self.sps, budget, max_lengths=max_lengths)

    def reset(self) -> None:
        """Forget past budgets (e.g. after the batch was drained)."""
        self._history.clear()


def make_length_policy(
    name: str,
    sps: StepsPerSecond,
    *,
    num_drafts: int | None = None,
    delay: int = 0,
    max_verify_tokens: int | None = None,
) -> LengthPolicy:
    """``--spec-schedule confidence|throughput|fixed`` -> a policy; a bad name is a one-line error."""
    if name == "fixed":
        return FixedPolicy(sps, num_drafts)
    if name == "confidence":
        return ConfidencePolicy(sps, delay=delay, max_verify_tokens=max_verify_tokens, min_share=ACCEPTED_FLOOR)
    if name == "throughput":
        return ConfidencePolicy(sps, delay=delay, max_verify_tokens=max_verify_tokens)
    raise ValueError(f"unknown spec schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
