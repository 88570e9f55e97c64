"""The gateway's routing of one attempt: a prefill and a decode engine chosen together, by policy.

    routing = Routing("tiered", cache_view)
    prefill, decode = routing.choose(info, prefill_loads, decode_loads, now)
    routing.on_prefilled(num_prompt_tokens, num_cached_tokens, cached_tokens_by_tier)

Policies (``[gateway] routing`` of the cluster file, or a gateway node's ``routing``):

- ``tiered`` (ours): ``TieredPrefillRouter`` (context-length tiers, the longest cached prefix
  traded against load under an imbalance bound, the KV store as a holder every engine shares)
  and ``TwoDimDecodeBalancer`` (request count and KV length);
- ``affinity-only``: the engine with the longest cached prefix whatever its load, the same
  decode balancer;
- ``round-robin``: the next prefill and the next decode engine in turn, caches ignored.

Both choices are made from the same snapshot of loads, so the decode target is fixed when the
request is routed (its prefill hands off to it). ``RouterStats`` counts what was routed and what
the prefill engines then reported as cached, by tier; ``RouterCollector`` puts the counters and
the cache view's size on the gateway's /metrics as ``deepinfer_router_*``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deepinfer.runtime.balance import (
    AffinityOnly,
    PrefillRouterConfig,
    DecodeChoice,
    DecodeLoad,
    PrefillChoice,
    PrefillLoad,
    RequestInfo,
    RoundRobin,
    TieredPrefillRouter,
    TwoDimDecodeBalancer,
)
from deepinfer.runtime.cluster_config import ROUTING_POLICIES
from deepinfer.runtime.disagg.cache_view import CacheView

GATEWAY_LOAD_NOISE_S = 0.25  # a gateway's view: reports every ~0.1 s, other gateways' routing unseen


@dataclass(slots=True)
class RouterStats:
    num_routed: int = 0
    num_affinity: int = 0  # routes where a cached prefix, not load, decided the prefill engine
    num_predicted_cached_tokens: int = 0  # what the policy expected the prefill to find cached
    num_prompt_tokens: int = 0  # prompt tokens of attempts whose prefill answered
    num_cached_tokens: int = 0  # ... of them found cached (any tier), as the prefill reported
    prefill2routed: Counter = field(default_factory=Counter)  # prefill engine id -> attempts
    decode2routed: Counter = field(default_factory=Counter)
    tier2cached_tokens: Counter = field(default_factory=Counter)  # "device" / "host" / "store"
    num_attempts_lost: int = 0


class Routing:
    def __init__(self, policy: str, cache: CacheView, config: PrefillRouterConfig | None = None):
        """``config``: the tiered router's settings (the gateway's default counts load differences
        under ``load_noise_s`` = 0.25 s as noise)."""
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {policy!r}: expected one of {', '.join(ROUTING_POLICIES)}")
        self.policy = policy
        self.cache = cache
        self.stats = RouterStats()
        if policy == "round-robin":
            self._prefill, self._decode = RoundRobin(), RoundRobin()  # one turn each: a shared one skips
        else:
            config = config or PrefillRouterConfig(load_noise_s=GATEWAY_LOAD_NOISE_S)
            self._prefill = TieredPrefillRouter(cache.index, config=config) if policy == "tiered" \
                else AffinityOnly(cache.index)
            self._decode = TwoDimDecodeBalancer()

    def request_info(self, request_id: str, token_ids: Sequence[int]) -> RequestInfo:
        """What the policies see of a request: its length and its full blocks' chain hashes."""
        hashes = self.cache.block_hashes(token_ids) if self.policy != "round-robin" else []
        return RequestInfo(request_id, max(1, len(token_ids)), hashes, max(1, self.cache.block_size))

    def choose(self, info: RequestInfo, prefill_loads: Sequence[PrefillLoad], decode_loads: Sequence[DecodeLoad],
               now: float) -> tuple[PrefillChoice, DecodeChoice]:
        if self.policy == "tiered":
            prefill = self._prefill.route(info, prefill_loads, now, self.cache.store.num_leading(info.block_hashes))
        else:
            prefill = self._prefill.route(info, prefill_loads, now)
        decode = self._decode.place(info, decode_loads)
        stats = self.stats
        stats.num_routed += 1
        stats.num_affinity += prefill.is_affinity
        stats.num_predicted_cached_tokens += prefill.num_cached_tokens
        stats.prefill2routed[prefill.engine_id] += 1
        stats.decode2routed[decode.engine_id] += 1
        return prefill, decode

    def on_prefilled(self, num_prompt_tokens: int, num_cached_tokens: int, cached_tokens_by_tier: dict[str, int]) -> None:
        """The prefill engine answered: what it found cached."""
        stats = self.stats
        stats.num_prompt_tokens += num_prompt_tokens
        stats.num_cached_tokens += num_cached_tokens
        stats.tier2cached_tokens.update({tier: n for tier, n in cached_tokens_by_tier.items() if n})


class RouterCollector:
    """``deepinfer_router_*`` of one gateway, read at scrape time."""

    def __init__(self, routing: Routing, engine_names: dict[tuple[str, int], str], engines_up):
        """``engine_names``: (role, engine id) -> node name; ``engines_up()``: role -> engines up now."""
        self._routing = routing
        self._names = engine_names
        self._engines_up = engines_up

    def collect(self):
        r, stats, cache = self._routing, self._routing.stats, self._routing.cache

        def counter(name: str, text: str, value: float):
            family = CounterMetricFamily(f"deepinfer_router_{name}", text, labels=["policy"])
            family.add_metric([r.policy], float(value))
            return family

        yield counter("routed", "attempts routed (a prefill and a decode engine chosen)", stats.num_routed)
        yield counter("affinity_routes", "routes decided by a cached prefix rather than load", stats.num_affinity)
        yield counter("predicted_cached_tokens", "prompt tokens the policy expected cached", stats.num_predicted_cached_tokens)
        yield counter("prompt_tokens", "prompt tokens of attempts whose prefill answered", stats.num_prompt_tokens)
        yield counter("cached_tokens", "prompt tokens the prefill engines found cached", stats.num_cached_tokens)
        yield counter("attempts_lost", "attempts lost to a dead, cut-off or failing engine", stats.num_attempts_lost)
        by_tier = CounterMetricFamily("deepinfer_router_cached_tokens_by_tier", "cached prompt tokens by the tier "
                                      "they came from (device, host, store)", labels=["policy", "tier"])
        for tier in ("device", "host", "store"):
            by_tier.add_metric([r.policy, tier], float(stats.tier2cached_tokens.get(tier, 0)))
        yield by_tier
        for role, routed in (("prefill", stats.prefill2routed), ("decode", stats.decode2routed)):
            family = CounterMetricFamily(f"deepinfer_router_{role}_routed", f"attempts routed to each {role} engine",
                                         labels=["policy", "engine"])
            for engine_id, count in sorted(routed.items()):
                family.add_metric([r.policy, self._names.get((role, engine_id), str(engine_id))], float(count))
            yield family
        view = cache.stats
        for name, value, text in (("kv_events", view.num_events, "cache event messages applied"),
                                  ("kv_snapshots", view.num_snapshots, "cache snapshots applied"),
                                  ("kv_event_gaps", view.num_gaps, "times an engine's events were found lost")):
            yield counter(name, text, value)
        indexed = GaugeMetricFamily("deepinfer_router_indexed_blocks", "blocks of each prefill engine's cache in the "
                                    "prefix index", labels=["engine"])
        for (role, engine_id), node in sorted(self._names.items()):
            if role == "prefill":
                indexed.add_metric([node], float(cache.num_indexed_blocks(engine_id)))
        yield indexed
        yield GaugeMetricFamily("deepinfer_router_store_blocks", "blocks the KV store is believed to hold",
                                value=float(len(cache.store)))
        up = GaugeMetricFamily("deepinfer_router_engines_up", "engines up and not draining", labels=["role"])
        for role, count in self._engines_up().items():
            up.add_metric([role], float(count))
        yield up
