"""The policy bundles a simulation compares: a prefill router, a decode balancer, a VE balancer.

Every bundle routes the same trace; only the decisions differ. ``is_affinity_only`` marks the
bundles whose prefill routing ignores load (the hit-rate reference).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.runtime.balance import (
    AffinityOnly,
    ApproxCacheAware,
    CacheAwareConfig,
    DecodeStepCost,
    LeastRequests,
    PrefillCost,
    PrefillRouterConfig,
    PrefixIndex,
    RoundRobin,
    TieredPrefillRouter,
    TierPlanner,
    TwoDimDecodeBalancer,
    VEBalancer,
)


@dataclass(slots=True)
class PolicySet:
    name: str
    prefill: object  # .route(RequestInfo, [PrefillLoad], now) -> PrefillChoice
    decode: object  # .place(RequestInfo, [DecodeLoad]) -> DecodeChoice
    ve: object  # .assign(image_tokens, [VELoad]) -> VEPlan
    index: PrefixIndex | None  # fed with the engines' cache events when the router reads them
    is_affinity_only: bool = False


DEFAULT_POLICIES = ("round-robin", "least-requests", "sglang-cache-aware", "affinity-only", "ours")
EXTRA_POLICIES = ("ours-no-tiers", "ours-prefill+lr-decode")
OURS = "ours"


def is_affinity_only(name: str) -> bool:
    return name == "affinity-only"


def build_planner(name: str) -> TierPlanner | None:
    """The cluster-wide tier plan a policy's routers share (None: the policy does not tier)."""
    if name in ("ours", "ours-prefill+lr-decode"):
        return TierPlanner()
    if name == "ours-no-tiers":
        return TierPlanner(tier_bounds=())
    return None


def build_policy(name: str, prefill_cost: PrefillCost, decode_cost: DecodeStepCost, cache_blocks: int,
                 index: PrefixIndex | None = None, planner: TierPlanner | None = None) -> PolicySet:
    """One gateway's policies. Gateways of one cluster share ``index`` (they all receive the same
    cache events) and ``planner`` (one tier plan), and keep the rest of their state private."""
    if name == "round-robin":
        return PolicySet(name, RoundRobin(), RoundRobin(), RoundRobin(), None)
    if name == "least-requests":
        return PolicySet(name, LeastRequests(), LeastRequests(), RoundRobin(), None)
    if name == "sglang-cache-aware":
        # the router's tree is trimmed to what one engine can cache, as an operator would set it
        router = ApproxCacheAware(CacheAwareConfig(max_tree_blocks=cache_blocks))
        return PolicySet(name, router, LeastRequests(), RoundRobin(), None)
    if name == "affinity-only":
        index = index or PrefixIndex()
        return PolicySet(name, AffinityOnly(index), LeastRequests(), RoundRobin(), index, is_affinity_only=True)
    if name in ("ours", "ours-no-tiers", "ours-prefill+lr-decode"):
        index = index or PrefixIndex()
        router = TieredPrefillRouter(index, prefill_cost, PrefillRouterConfig(), planner or build_planner(name))
        decode = LeastRequests() if name == "ours-prefill+lr-decode" else TwoDimDecodeBalancer(decode_cost)
        return PolicySet(name, router, decode, VEBalancer(), index)
    known = ", ".join(DEFAULT_POLICIES + EXTRA_POLICIES)
    raise ValueError(f"unknown policy {name!r}; choose from {known}")
