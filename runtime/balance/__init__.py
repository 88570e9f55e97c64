"""Load balancing across replicas (ARCHITECTURE.md, "Balancers"): pure policies over typed load snapshots.

``TieredPrefillRouter`` (tiers + prefix affinity under an imbalance bound), ``TwoDimDecodeBalancer``
(request count and KV length together), ``VEBalancer`` (pending image tokens), and the baselines
they are measured against (``RoundRobin``, ``LeastRequests``, ``AffinityOnly``,
``ApproxCacheAware``). No sockets, no clock, no asyncio: a gateway feeds loads, cache events and
``now``; ``deepinfer bench balance`` drives the same objects in a discrete-event simulator.
"""

from deepinfer.runtime.balance.baselines import (
    AffinityOnly,
    ApproxCacheAware,
    CacheAwareConfig,
    LeastRequests,
    RoundRobin,
)
from deepinfer.runtime.balance.cost_model import DecodeStepCost, PrefillCost
from deepinfer.runtime.balance.decode_balancer import TwoDimDecodeBalancer
from deepinfer.runtime.balance.load_view import DecodeLoadView, PrefillLoadView
from deepinfer.runtime.balance.prefill_router import PrefillRouterConfig, TieredPrefillRouter
from deepinfer.runtime.balance.prefix_index import PrefixIndex
from deepinfer.runtime.balance.tier_planner import TierPlanner
from deepinfer.runtime.balance.tiers import DEFAULT_TIER_BOUNDS, apportion, reassign, tier_of
from deepinfer.runtime.balance.types import (
    DecodeChoice,
    DecodeLoad,
    PrefillChoice,
    PrefillLoad,
    RequestInfo,
    VELoad,
    VEPlan,
)
from deepinfer.runtime.balance.ve_balancer import VEBalancer

__all__ = [
    "DEFAULT_TIER_BOUNDS",
    "AffinityOnly",
    "ApproxCacheAware",
    "CacheAwareConfig",
    "DecodeChoice",
    "DecodeLoad",
    "DecodeLoadView",
    "DecodeStepCost",
    "LeastRequests",
    "PrefillChoice",
    "PrefillCost",
    "PrefillLoad",
    "PrefillLoadView",
    "PrefillRouterConfig",
    "PrefixIndex",
    "RequestInfo",
    "RoundRobin",
    "TierPlanner",
    "TieredPrefillRouter",
    "TwoDimDecodeBalancer",
    "VEBalancer",
    "VELoad",
    "VEPlan",
    "apportion",
    "reassign",
    "tier_of",
]
