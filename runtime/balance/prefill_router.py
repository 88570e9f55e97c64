"""The prefill router: context-length tiers, then prefix affinity traded against load.

Per request (``route``):

1. Tier by total context length (``tiers.DEFAULT_TIER_BOUNDS``: <16K, 16-64K, 64-256K, >=256K).
   Candidates are the engines of that tier and of longer tiers: long work is confined to the
   engines planned for it, so a 2K-token chat turn never finds a shorter tier's engine busy with a
   400K-token document, while short work may fill any engine. A shorter tier's engine is also a
   candidate when its cached prefix leaves little work (an agent whose context just grew past a
   bound keeps its cache). A tier with no engines at or above it borrows the nearest shorter one.
2. For every candidate engine, the prefix it holds (``PrefixIndex``, fed by cache events) gives
   the tokens it would skip, and the quadratic cost model the seconds it would compute:
   ``cost_e = t(L - hit_e, hit_e)``. The KV store is a holder every engine shares: when the
   store holds a longer prefix (``num_store_blocks``) an engine loads the part past its own hit,
   at ``store_read_s + store_load_s_per_token`` per token loaded, so a device hit still beats the
   same prefix from the store. The score is ``backlog_e + (1 + compute_weight) * cost_e``:
   the request's expected finish time plus a charge for the compute it takes from everyone else
   (a hit saves capacity as well as latency).
3. Explicit imbalance bound: an engine is eligible only if its backlog exceeds the least-loaded
   candidate's by at most ``imbalance_abs_s + imbalance_rel * t(L, 0)``. With equal loads the
   longest prefix wins; past the bound a hot prefix cannot pile work onto one engine, however
   much it would save. ``load_noise_s``: backlog differences a gateway's load view cannot
   resolve (reports come every ~100 ms, other gateways' routing is unseen) count as equal: only
   backlog beyond the least-loaded candidate's + ``load_noise_s`` enters the score. 0 (the
   default, exact loads as in the simulator) counts every difference.

Per round (every ``round_s`` seconds of the ``now`` the caller passes) a ``TierPlanner``, shared
by every gateway of the cluster, re-assigns engines to tiers in proportion to each tier's compute
in the round that ended, and measures utilisation rho: the compute charge is
``compute_weight * rho / (1 - rho)`` (the delay one second of work imposes on the requests queued
behind it grows like rho / (1 - rho)), so a hit is worth more waiting the busier the cluster is.

The router holds no sockets and no clock: a gateway passes live loads (heartbeat + what it routed
since) and ``now``, and feeds engines' cache events to the shared ``PrefixIndex``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.runtime.balance.cost_model import PrefillCost
from deepinfer.runtime.balance.prefix_index import PrefixIndex
from deepinfer.runtime.balance.tier_planner import TierPlanner
from deepinfer.runtime.balance.types import PrefillChoice, PrefillLoad, RequestInfo


@dataclass(frozen=True, slots=True)
class PrefillRouterConfig:
    imbalance_abs_s: float = 3.0
    imbalance_rel: float = 2.5
    compute_weight: float = 1.0
    is_adaptive_weight: bool = True  # scale compute_weight by rho / (1 - rho) of the last round
    descent_fraction: float = 0.5  # lower tiers accept work up to t(fraction x their bound, 0)
    # loading a prefix from the KV store: V4.1's ~890 B/token at ~5 GB/s per GPU, plus a read's latency
    store_load_s_per_token: float = 2e-7
    store_read_s: float = 2e-3
    load_noise_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.imbalance_abs_s, self.imbalance_rel, self.compute_weight, self.store_load_s_per_token,
               self.store_read_s, self.load_noise_s) < 0:
            raise ValueError(f"imbalance bounds, compute_weight and store costs must be >= 0, got {self}")
        if not 0 <= self.descent_fraction <= 1:
            raise ValueError(f"descent_fraction must be in [0, 1], got {self.descent_fraction}")


class TieredPrefillRouter:
    def __init__(
        self,
        index: PrefixIndex,
        cost: PrefillCost | None = None,
        config: PrefillRouterConfig | None = None,
        planner: TierPlanner | None = None,
    ):
        self.index = index
        self.cost = cost or PrefillCost()
        self.config = config or PrefillRouterConfig()
        self.planner = planner or TierPlanner()
        bounds = self.planner.tier_bounds
        fraction = self.config.descent_fraction
        self._tier2envelope_s = [self.cost.seconds(int(b * fraction), 0) for b in bounds] + [float("inf")]

    def compute_weight(self) -> float:
        if not self.config.is_adaptive_weight:
            return self.config.compute_weight
        rho = min(0.95, self.planner.utilization)
        return self.config.compute_weight * max(0.25, rho / (1.0 - rho))

    def route(self, req: RequestInfo, loads: Sequence[PrefillLoad], now: float,
              num_store_blocks: int = 0) -> PrefillChoice:
        """``num_store_blocks``: leading blocks of ``req.block_hashes`` the KV store holds."""
        if not loads:
            raise ValueError("no prefill engine to route to: the load list is empty")
        planner = self.planner
        planner.maybe_end_round(now, loads)
        tier = planner.tier_of(req.num_prompt_tokens)
        engine2tier = planner.engine2tier
        candidates = self._candidates(tier, loads)
        engine2blocks = self.index.match(req.block_hashes)

        num_tokens = req.num_prompt_tokens
        miss_s = self.cost.seconds(num_tokens, 0)
        # a shorter tier's engine may take this request when the prefix it holds leaves no more
        # work than that tier accepts: the work, not the context, is what blocks a queue
        if engine2tier and tier > 0:
            ids = {load.engine_id for load in candidates}
            for load in loads:
                t = engine2tier.get(load.engine_id, tier)
                if t < tier and load.engine_id in engine2blocks and load.engine_id not in ids:
                    cached = req.num_cached_tokens(engine2blocks[load.engine_id])
                    if self.cost.seconds(num_tokens - cached, cached) <= self._tier2envelope_s[t]:
                        candidates.append(load)
        min_backlog = min(load.backlog_s for load in candidates)
        max_backlog = min_backlog + self.config.imbalance_abs_s + self.config.imbalance_rel * miss_s
        charge = 1.0 + self.compute_weight()
        cfg = self.config
        best_key, best = None, None
        for load in candidates:
            if load.backlog_s > max_backlog:
                continue
            num_device = engine2blocks.get(load.engine_id, 0)
            cached = req.num_cached_tokens(max(num_device, num_store_blocks))
            cost_s = self.cost.seconds(num_tokens - cached, cached) if cached else miss_s
            num_loaded = cached - req.num_cached_tokens(num_device)
            if num_loaded > 0:  # the part past its own hit comes from the store
                cost_s += cfg.store_read_s + cfg.store_load_s_per_token * num_loaded
            waited_s = max(load.backlog_s, min_backlog + cfg.load_noise_s) if cfg.load_noise_s else load.backlog_s
            key = (waited_s + charge * cost_s, load.backlog_s, load.engine_id)
            if best_key is None or key < best_key:
                best_key, best = key, (load, cached, cost_s)
        load, cached, cost_s = best
        planner.record(load.engine_id, tier, now + load.backlog_s, now + load.backlog_s + cost_s)
        is_affinity = cached > 0 and load.backlog_s > min_backlog
        return PrefillChoice(load.engine_id, tier, cached, cost_s, is_affinity)

    # ---- tiers ----------------------------------------------------------------------
    def _candidates(self, tier: int, loads: Sequence[PrefillLoad]) -> list[PrefillLoad]:
        """Engines of the request's tier or a longer one (short work may fill engines kept for
        long work); a tier with no engines at or above it borrows the nearest shorter tier."""
        engine2tier = self.planner.engine2tier
        if not engine2tier:
            return list(loads)
        # engines that joined since the last round serve every tier until the next one
        found = [load for load in loads if engine2tier.get(load.engine_id, tier) >= tier]
        for t in range(tier - 1, -1, -1):
            if found:
                break
            found = [load for load in loads if engine2tier.get(load.engine_id) == t]
        return found or list(loads)
