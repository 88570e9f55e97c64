"""The decode balancer: request count and KV length balanced together.

Decode ranks of one expert-parallel group step in lockstep, so the group runs at the pace of its
slowest rank, and a rank's step time has two load terms (``cost_model.DecodeStepCost``): one per
request (``c_req * B_r``) and one per KV token (``c_kv * K_r``). Balancing only one of them fails
on real traffic: equal counts leave one rank with all the 500K-token agents, equal KV leaves one
rank with hundreds of short chats.

Placing a request of KV length L on rank e moves both dimensions, by 1 and by L. The rank chosen is
the one that least increases the sum over dimensions of (cost share) x (deviation from the mean,
in units of the mean)^2. Dropping the terms that are the same for every rank leaves

    score_e = c_req * B_e / mean_B  +  c_kv * L * K_e / mean_K

so for a short request (small L) the count term dominates and it goes where there are few
requests even if their caches are long; for a long request the KV term dominates and it goes
where caches are small. Both dimensions include requests already assigned but still in prefill
(the handoff target is fixed when the request is routed, so they will arrive here).

Ranks without a free slot or without KV room are skipped; if every rank is full the least full
one is returned with ``is_over_capacity`` set (it queues there).
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.runtime.balance.cost_model import DecodeStepCost
from deepinfer.runtime.balance.types import DecodeChoice, DecodeLoad, RequestInfo


class TwoDimDecodeBalancer:
    def __init__(self, cost: DecodeStepCost | None = None):
        self.cost = cost or DecodeStepCost()

    def place(self, req: RequestInfo, loads: Sequence[DecodeLoad]) -> DecodeChoice:
        if not loads:
            raise ValueError("no decode engine to hand off to: the load list is empty")
        num_kv = req.num_prompt_tokens
        num_engines = len(loads)
        mean_b = max(1.0, sum(load.num_requests for load in loads) / num_engines)
        # floors keep the weights finite on a near-empty group, where "units of the mean" mean little
        mean_k = max(float(num_kv), sum(load.num_kv_tokens for load in loads) / num_engines)
        w_b = self.cost.c_req / mean_b
        w_k = self.cost.c_kv * num_kv / mean_k
        best_key, best_id = None, -1
        for load in loads:
            if load.num_requests >= load.max_requests or load.num_kv_tokens + num_kv > load.kv_capacity_tokens:
                continue
            key = (w_b * load.num_requests + w_k * load.num_kv_tokens, load.engine_id)
            if best_key is None or key < best_key:
                best_key, best_id = key, load.engine_id
        if best_key is not None:
            return DecodeChoice(best_id, False)
        fullest = min(
            loads,
            key=lambda d: (
                max(d.num_requests / d.max_requests, (d.num_kv_tokens + num_kv) / d.kv_capacity_tokens),
                d.engine_id,
            ),
        )
        return DecodeChoice(fullest.engine_id, True)
