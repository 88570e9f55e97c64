"""DSpark speculative decoding. So far the pure policy part: how many drafts to verify.

    confidences [R, D] -> survival a = cumprod -> global sort -> lengths L [R] maximising
    expected committed tokens x SPS(B), B = R + sum L (length_schedule.py)

``SpsProfile`` holds the measured steps per second at B verify tokens (sps_profile.py);
``FixedPolicy`` / ``ConfidencePolicy`` are what an engine holds, the latter with the production
variant that sizes the budget from confidences two steps old (length_policy.py).
"""

from deepinfer.engine.spec.length_policy import (
    SCHEDULES,
    ConfidencePolicy,
    FixedPolicy,
    LengthPolicy,
    make_length_policy,
)
from deepinfer.engine.spec.length_schedule import (
    Schedule,
    expected_tokens,
    fill_budget,
    schedule_exhaustive,
    schedule_fixed,
    schedule_lengths,
    survival,
)
from deepinfer.engine.spec.sps_profile import SpsProfile

__all__ = [
    "SCHEDULES", "ConfidencePolicy", "FixedPolicy", "LengthPolicy", "Schedule", "SpsProfile",
    "expected_tokens", "fill_budget", "make_length_policy", "schedule_exhaustive", "schedule_fixed",
    "schedule_lengths", "survival",
]
