"""Cost models the balancers reason with: quadratic prefill time, linear decode step time.

Prefill (ARCHITECTURE.md, "Balancers"). Computing ``n`` new tokens on top of ``p`` cached ones costs

    t(n, p) = c_seq + c_tok * n + c_ctx * n * p + c_sq * n^2

(per-request overhead; projections + MoE, linear in new tokens; the new queries attending to the
cached prefix; the new queries attending to each other). It is the same form the engine fits to
measured steps (``deepinfer.engine.sched.cost_model``: coefficients ``c_seq, c_tok, c_ctx, c_sq``), so a
gateway can build one from the coefficients engines report. The defaults are an estimate for one
H200 rank serving DeepSeek-V4.1-Flash: about 25 GFLOP per new token at 400 TFLOP/s effective FP8
(c_tok = 6e-5 s, ~16K tokens/s) and about 1e5 FLOP per (query, key) pair for the lightning
indexers (c_ctx = 2 * c_sq = 2.5e-10 s), so the quadratic term overtakes the linear one near 480K
tokens: a cold 1M-token prompt costs about 185 s, a cold 16K-token one about 1 s.

Decode. Decode ranks of one expert-parallel group step in lockstep (the MoE all-to-all joins
them), so a step lasts as long as its slowest rank:

    rank r:  c_step + c_req * B_r + c_kv * K_r      (B_r requests, K_r KV tokens on rank r)
    shared:  c_moe + c_moe_tok * mean_r B_r         (routed experts, balanced by EPLB)
    step  =  max_r rank(r) + shared

Defaults put a rank with 60 requests of 40K tokens at about 18 ms per step, a quarter of it
proportional to KV length (attention and indexer reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillCost:
    c_seq: float = 5e-3
    c_tok: float = 6e-5
    c_ctx: float = 2.5e-10
    c_sq: float = 1.25e-10

    def __post_init__(self) -> None:
        if min(self.c_seq, self.c_tok, self.c_ctx, self.c_sq) < 0:
            raise ValueError(f"prefill cost coefficients must be non-negative, got {self}")

    def seconds(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        n = num_new_tokens
        return self.c_seq + n * (self.c_tok + self.c_ctx * num_cached_tokens + self.c_sq * n)


@dataclass(frozen=True, slots=True)
class DecodeStepCost:
    c_step: float = 4e-3
    c_req: float = 6e-5
    c_kv: float = 2e-9
    c_moe: float = 3e-3
    c_moe_tok: float = 4e-5

    def __post_init__(self) -> None:
        if min(self.c_step, self.c_req, self.c_kv, self.c_moe, self.c_moe_tok) < 0:
            raise ValueError(f"decode step cost coefficients must be non-negative, got {self}")

    def rank_seconds(self, num_requests: float, num_kv_tokens: float) -> float:
        return self.c_step + self.c_req * num_requests + self.c_kv * num_kv_tokens

    def shared_seconds(self, mean_requests: float) -> float:
        return self.c_moe + self.c_moe_tok * mean_requests

    def step_seconds(self, rank2requests: Sequence[float], rank2kv: Sequence[float]) -> float:
        """Lockstep step time: the slowest rank plus the shared expert work."""
        if len(rank2requests) != len(rank2kv):
            raise ValueError(f"{len(rank2requests)} request counts but {len(rank2kv)} KV lengths")
        c_req, c_kv = self.c_req, self.c_kv
        slowest = max([c_req * b + c_kv * k for b, k in zip(rank2requests, rank2kv)])
        return self.c_step + slowest + self.shared_seconds(sum(rank2requests) / len(rank2requests))

    def step_and_balanced_seconds(self, rank2requests: Sequence[float], rank2kv: Sequence[float]) -> tuple[float, float]:
        """``(step_seconds, balanced_step_seconds)`` in one pass (a simulator calls it every step)."""
        c_req, c_kv = self.c_req, self.c_kv
        num_ranks = len(rank2requests)
        total_b, total_k = sum(rank2requests), sum(rank2kv)
        shared = self.shared_seconds(total_b / num_ranks)
        slowest = max([c_req * b + c_kv * k for b, k in zip(rank2requests, rank2kv)])
        balanced = self.rank_seconds(total_b / num_ranks, total_k / num_ranks)
        return self.c_step + slowest + shared, balanced + shared

    def balanced_step_seconds(self, rank2requests: Sequence[float], rank2kv: Sequence[float]) -> float:
        """The same step's work split perfectly evenly over the ranks (fractions allowed)."""
        num_ranks = len(rank2requests)
        mean_b = sum(rank2requests) / num_ranks
        return self.rank_seconds(mean_b, sum(rank2kv) / num_ranks) + self.shared_seconds(mean_b)
