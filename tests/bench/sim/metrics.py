"""What one policy achieved on one trace, and the decode balance efficiency baseline.

Decode balance efficiency. The decode ranks form one expert-parallel group stepping in lockstep,
so every step lasts as long as its slowest rank. For each step s we know what ran on each rank
(requests B_r, KV tokens K_r) and record two times:

    achieved  T_s = max_r rank(B_r, K_r) + shared(mean B)
    balanced  T*_s = rank(mean B, mean K) + shared(mean B)

T*_s is the step time of a *perfectly balanced offline assignment of the same requests*: the
same work at the same moment, split evenly over the ranks with fractions allowed. No real
assignment (online or offline, knowing every output length in advance) can beat it, because
step time is linear per rank and the max of the ranks is at least their mean. Both schedules
emit the same tokens per step, so throughput(achieved) / throughput(balanced) is

    efficiency = sum_s T*_s / sum_s T_s            (over the steps of the measurement window)

1.0 means no step ever waited on an overloaded rank. Because the baseline is an upper bound, the
figure is a lower bound on efficiency against the best integral offline assignment. Slot limits
(a request waiting at a full rank while another rank has room) do not enter it; they show as the
first-gap part of the ITL figures.

ITL percentiles are over tokens: every token emitted by a decode step counts that step's time,
and each request's second token counts its gap from the first (handoff + slot wait + one step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100.0 * len(ordered) + 0.5)) - 1))
    return ordered[k]


def weighted_percentile(pairs: Sequence[tuple[float, float]], q: float) -> float:
    """Percentile of values carrying weights: pairs of (value, weight)."""
    pairs = sorted(p for p in pairs if p[1] > 0)
    if not pairs:
        return 0.0
    total = sum(w for _, w in pairs)
    target = q / 100.0 * total
    acc = 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= target:
            return value
    return pairs[-1][0]


@dataclass(slots=True)
class PolicyResult:
    name: str
    num_requests: int  # turns that arrived inside the measurement window
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_short_p99_s: float  # prompts under 16K tokens: the interactive bulk
    itl_p50_ms: float
    itl_p99_ms: float
    throughput_tok_s: float  # output tokens emitted inside the window per second
    hit_rate: float  # cached prompt tokens / prompt tokens, window requests
    decode_balance_efficiency: float
    prefill_utilization: float  # prefill busy seconds inside the window / (engines x window)
    decode_occupancy: float  # mean running requests / decode slots, window steps
    ve_wait_p99_s: float  # image requests: arrival to last image encoded
    cpu_s: float  # host CPU seconds this policy's simulation took
    # (session id, turn) -> (cached tokens, prompt tokens) of every window request: hit rates of
    # different policies are compared over the turns all of them served (``same_turn_hit_rates``)
    turn2tokens: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict, repr=False)


def same_turn_hit_rates(a: PolicyResult, b: PolicyResult) -> tuple[float, float]:
    """Hit rates of two policies over the turns that arrived inside the window under both.

    Later turns arrive after earlier replies, so a slow policy serves fewer (and earlier, less
    cacheable) turns in the window; comparing raw hit rates would mix that in.
    """
    common = a.turn2tokens.keys() & b.turn2tokens.keys()
    rates = []
    for r in (a, b):
        cached = sum(r.turn2tokens[t][0] for t in common)
        prompt = sum(r.turn2tokens[t][1] for t in common)
        rates.append(cached / prompt if prompt else 0.0)
    return rates[0], rates[1]
