"""Baseline routers the balancers are measured against (same inputs, same decisions).

- ``RoundRobin``: the next engine in turn (prefill, decode and vision encoder alike).
- ``LeastRequests``: the engine with the fewest outstanding requests; ties rotate.
- ``AffinityOnly``: the engine holding the longest cached prefix (exact, from cache events),
  ignoring load except to break ties. It has the best hit rate any router can get from the
  engines' caches, and no defence against hot prefixes.
- ``ApproxCacheAware``: SGLang router's cache-aware policy. The router keeps its own approximate
  prefix tree per engine, built from what it routed (no cache events) and trimmed LRU to a size
  limit. If the load is imbalanced (max - min outstanding requests > ``balance_abs_threshold``
  and max > ``balance_rel_threshold`` x min) it routes to the least loaded engine; otherwise to
  the engine with the longest matched prefix when match/prompt > ``cache_threshold``, else to the
  engine with the smallest tree (the most free cache). Over hash chains a radix tree with one node
  per block is exactly a set of chain hashes, so the "tree" here is a ``PrefixIndex``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.runtime.balance.prefix_index import PrefixIndex
from deepinfer.runtime.balance.types import (
    DecodeChoice,
    DecodeLoad,
    PrefillChoice,
    PrefillLoad,
    RequestInfo,
    VELoad,
    VEPlan,
)


def _require(loads: Sequence, what: str) -> None:
    if not loads:
        raise ValueError(f"no {what} to route to: the load list is empty")


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def _pick(self, loads: Sequence) -> int:
        engine_id = loads[self._next % len(loads)].engine_id
        self._next += 1
        return engine_id

    def route(self, req: RequestInfo, loads: Sequence[PrefillLoad], now: float) -> PrefillChoice:
        _require(loads, "prefill engine")
        return PrefillChoice(self._pick(loads), -1, 0, 0.0, False)

    def place(self, req: RequestInfo, loads: Sequence[DecodeLoad]) -> DecodeChoice:
        _require(loads, "decode engine")
        return DecodeChoice(self._pick(loads), False)

    def assign(self, image_tokens: Sequence[int], loads: Sequence[VELoad]) -> VEPlan:
        if not image_tokens:
            return VEPlan(())
        _require(loads, "vision-encoder instance")
        engine_id = self._pick(loads)
        return VEPlan((engine_id,) * len(image_tokens))


class LeastRequests:
    def __init__(self) -> None:
        self._turn = 0

    def _pick(self, loads: Sequence) -> int:
        # ties rotate: a fixed tie-break (lowest id) would load engine 0 first every time
        fewest = min(load.num_requests for load in loads)
        tied = [load.engine_id for load in loads if load.num_requests == fewest]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def route(self, req: RequestInfo, loads: Sequence[PrefillLoad], now: float) -> PrefillChoice:
        _require(loads, "prefill engine")
        return PrefillChoice(self._pick(loads), -1, 0, 0.0, False)

    def place(self, req: RequestInfo, loads: Sequence[DecodeLoad]) -> DecodeChoice:
        _require(loads, "decode engine")
        return DecodeChoice(self._pick(loads), False)


class AffinityOnly:
    def __init__(self, index: PrefixIndex):
        self.index = index

    def route(self, req: RequestInfo, loads: Sequence[PrefillLoad], now: float) -> PrefillChoice:
        _require(loads, "prefill engine")
        engine2blocks = self.index.match(req.block_hashes)
        best = min(loads, key=lambda d: (-engine2blocks.get(d.engine_id, 0), d.num_requests, d.backlog_s, d.engine_id))
        cached = req.num_cached_tokens(engine2blocks.get(best.engine_id, 0))
        return PrefillChoice(best.engine_id, -1, cached, 0.0, cached > 0)


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.1
    max_tree_blocks: int = 1 << 20  # per engine


class ApproxCacheAware:
    def __init__(self, config: CacheAwareConfig | None = None):
        self.config = config or CacheAwareConfig()
        self.trees = PrefixIndex()
        self._engine2lru: dict[int, OrderedDict] = {}

    def route(self, req: RequestInfo, loads: Sequence[PrefillLoad], now: float) -> PrefillChoice:
        _require(loads, "prefill engine")
        cfg = self.config
        most = max(load.num_requests for load in loads)
        fewest = min(load.num_requests for load in loads)
        engine2blocks = self.trees.match(req.block_hashes)
        if most - fewest > cfg.balance_abs_threshold and most > cfg.balance_rel_threshold * fewest:
            chosen = min(loads, key=lambda d: (d.num_requests, d.engine_id))
            is_affinity = False
        else:
            best = min(loads, key=lambda d: (-engine2blocks.get(d.engine_id, 0), d.num_requests, d.engine_id))
            match_rate = engine2blocks.get(best.engine_id, 0) * req.block_size / req.num_prompt_tokens
            is_affinity = match_rate > cfg.cache_threshold
            if is_affinity:
                chosen = best
            else:
                chosen = min(loads, key=lambda d: (self.trees.num_blocks(d.engine_id), d.num_requests, d.engine_id))
        self._insert(chosen.engine_id, req.block_hashes)
        cached = req.num_cached_tokens(engine2blocks.get(chosen.engine_id, 0))
        return PrefillChoice(chosen.engine_id, -1, cached, 0.0, is_affinity)

    def _insert(self, engine_id: int, hashes: Sequence) -> None:
        lru = self._engine2lru.setdefault(engine_id, OrderedDict())
        new = []
        # tail first, so the root ends most recent and LRU trims leaves before their parents
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                new.append(h)
        self.trees.on_stored(engine_id, new)
        num_over = len(lru) - self.config.max_tree_blocks
        if num_over > 0:
            self.trees.on_evicted(engine_id, [lru.popitem(last=False)[0] for _ in range(num_over)])
