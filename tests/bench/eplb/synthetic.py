"""Synthetic routing traces: Zipf-like topic popularity that drifts, bursts, per-request skew.

The story, chosen from how serving traffic behaves rather than to favour any placement:

* Experts specialise by topic. Each of ``num_topics`` topics has, per layer, a Zipf-like
  affinity over the experts (exponent ``expert_zipf`` over a random permutation): a topic's top
  expert takes ~7 % of its tokens, 17x the mean. The router's bias balances experts over the
  training mix, so no expert is hot for every topic; imbalance comes from the traffic mix.
* The traffic mix over topics is Zipf-like too (``topic_zipf``) and drifts: the log-share of every
  topic follows an Ornstein-Uhlenbeck process (std ``drift_sigma``, time constant
  ``drift_minutes``). Bursts (a batch job, a launch) arrive every ``burst_every_minutes`` on
  average, last ``burst_minutes`` on average and take ``burst_share`` of the traffic for one topic.
* Prefill (``kind="prefill"``): each of the group's DP ranks processes ``chunk_tokens`` per step
  (the 32K budget of ARCHITECTURE.md, "Balancers") from its own queue of requests, whose uncached prompt tokens are
  log-normal (median ``median_prompt_tokens`` = 2K, sigma 1.5: bench balance's workload, where
  most of a turn's prompt is a cached prefix and documents add the tail); long prompts span
  steps, as chunked prefill does. Each request's
  expert profile is its topic's affinity times log-normal noise (``request_sigma``): one prompt is
  narrower than its topic. A step therefore holds a handful of requests and its load moves
  with them: most of what no placement can fix.
* Decode (``kind="decode"``): ``ranks * seqs_per_rank`` sequences verify ``tokens_per_seq`` tokens
  per step (DSpark). The running set follows the traffic mix with the lag of a sequence's
  lifetime (``seq_steps``); thousands of sequences average their own skew away.
* Counts are Poisson around top_k * (expected tokens), per step, layer and expert.

Time: a prefill step of 32K tokens per rank takes about 2 s (~16K tokens/s per rank, the V4.1-
Flash cost model of bench balance), a decode step about 15 ms (assumed: ~10 ms at 20 requests,
here 64 verifying 4 tokens each), so the same minutes of drift and bursts are ~130x more steps
for decode. Defaults follow V4-Flash: 256 experts, top-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TraceConfig:
    kind: str  # "prefill" | "decode"
    num_steps: int
    ranks: int  # DP ranks feeding the EP group
    num_layers: int = 4
    num_experts: int = 256
    top_k: int = 6
    num_topics: int = 32
    topic_zipf: float = 1.0
    expert_zipf: float = 0.7
    drift_sigma: float = 0.5
    drift_minutes: float = 30.0
    burst_every_minutes: float = 10.0
    burst_minutes: float = 3.0
    burst_share: float = 0.3
    step_seconds: float = 2.0  # prefill ~2 s per 32K-token chunk, decode ~0.015 s
    # prefill
    chunk_tokens: int = 32768
    median_prompt_tokens: int = 2000
    prompt_sigma: float = 1.5
    max_prompt_tokens: int = 1 << 20
    request_sigma: float = 0.5
    # decode
    seqs_per_rank: int = 64
    tokens_per_seq: int = 4
    seq_steps: int = 150
    seed: int = 0


def prefill_config(num_steps: int, ranks: int, **kw) -> TraceConfig:
    return TraceConfig(kind="prefill", num_steps=num_steps, ranks=ranks, step_seconds=2.0, **kw)


def decode_config(num_steps: int, ranks: int, **kw) -> TraceConfig:
    return TraceConfig(kind="decode", num_steps=num_steps, ranks=ranks, step_seconds=0.015, **kw)


class SyntheticTrace:
    """Generates ``config.num_steps`` steps of counts [layers, experts], chunk by chunk."""

    def __init__(self, config: TraceConfig):
        if config.kind not in ("prefill", "decode"):
            raise ValueError(f"trace kind must be prefill or decode, got {config.kind!r}")
        self.config = c = config
        self.rng = np.random.default_rng(c.seed)
        rng = self.rng
        # [topics, layers, experts]: Zipf over a random permutation of experts per (topic, layer)
        ranks = rng.permuted(np.tile(np.arange(1, c.num_experts + 1), (c.num_topics, c.num_layers, 1)), axis=-1)
        affinity = ranks.astype(np.float64) ** -c.expert_zipf
        self.affinity = affinity / affinity.sum(axis=-1, keepdims=True)
        self.base_log_share = -c.topic_zipf * np.log(rng.permutation(c.num_topics) + 1.0)
        self.drift = rng.normal(0.0, c.drift_sigma, c.num_topics)  # stationary start
        steps_per_minute = 60.0 / c.step_seconds
        self.drift_steps = c.drift_minutes * steps_per_minute
        self.burst_rate = 1.0 / (c.burst_every_minutes * steps_per_minute)  # per step
        self.burst_steps = c.burst_minutes * steps_per_minute
        self.burst_topic, self.burst_left = -1, 0.0
        self.step = 0
        # prefill: per rank, the request in progress (tokens left, profile [layers, experts])
        self.left = np.zeros(c.ranks, dtype=np.int64)
        self.profile = [None] * c.ranks
        # decode: the running set's topic fractions, lagging the traffic mix
        self.running = self.mix()

    def mix(self) -> np.ndarray:
        """[topics] the traffic share of each topic now, bursts included."""
        log_share = self.base_log_share + self.drift
        share = np.exp(log_share - log_share.max())
        share /= share.sum()
        if self.burst_left > 0:
            share = (1 - self.config.burst_share) * share
            share[self.burst_topic] += self.config.burst_share
        return share

    def advance(self) -> None:
        """One step of drift and bursts."""
        c, rng = self.config, self.rng
        decay = 1.0 / self.drift_steps
        self.drift += -decay * self.drift + c.drift_sigma * np.sqrt(2 * decay) * rng.normal(size=c.num_topics)
        self.burst_left -= 1
        if self.burst_left <= 0 and rng.random() < self.burst_rate:
            self.burst_topic = int(rng.integers(c.num_topics))
            self.burst_left = rng.exponential(self.burst_steps)
        self.step += 1

    def expected_prefill(self) -> np.ndarray:
        """[layers, experts] tokens of one step over all ranks' chunks."""
        c, rng = self.config, self.rng
        tokens = np.zeros((c.num_layers, c.num_experts))
        share = self.mix()
        for r in range(c.ranks):
            budget = c.chunk_tokens
            while budget > 0:
                if self.left[r] == 0:
                    length = rng.lognormal(np.log(c.median_prompt_tokens), c.prompt_sigma)
                    self.left[r] = int(min(max(length, 16), c.max_prompt_tokens))
                    topic = rng.choice(c.num_topics, p=share)
                    p = self.affinity[topic] * rng.lognormal(0.0, c.request_sigma, (c.num_layers, c.num_experts))
                    self.profile[r] = p / p.sum(axis=-1, keepdims=True)
                take = int(min(budget, self.left[r]))
                tokens += take * self.profile[r]
                self.left[r] -= take
                budget -= take
        return tokens

    def expected_decode(self) -> np.ndarray:
        c = self.config
        self.running += (self.mix() - self.running) / c.seq_steps
        total = c.ranks * c.seqs_per_rank * c.tokens_per_seq
        return total * np.einsum("k,kle->le", self.running, self.affinity)

    def chunks(self, chunk_steps: int = 1000):
        """Yields float32 arrays [n <= chunk_steps, layers, experts] until num_steps are out."""
        c = self.config
        expected = self.expected_prefill if c.kind == "prefill" else self.expected_decode
        done = 0
        while done < c.num_steps:
            n = min(chunk_steps, c.num_steps - done)
            lam = np.empty((n, c.num_layers, c.num_experts))
            for i in range(n):
                lam[i] = expected()
                self.advance()
            yield self.rng.poisson(c.top_k * lam).astype(np.float32)
            done += n
