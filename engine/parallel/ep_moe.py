"""An MoE layer run expert-parallel: attention is data-parallel (each rank routes its own
tokens), experts live on the ranks their physical slots name.

One forward on every rank of the group, in lockstep (a rank with no tokens calls
``forward_idle``):

    route     the replicated router picks each token's k experts             (home rank)
    choose    a replica per (token, expert) pair: EVEN or LEAST_LOADED        (eplb/replica_choice)
    counts    all-to-all of [rows, pairs, pairs under the other rule] per rank
    dispatch  all-to-all of token rows + local slot columns                   (dispatch.py layout)
              -- the shared expert computes meanwhile (async; NCCL's stream on GPU)
    compute   each slot's pairs through its expert                            (expert_slots)
    combine   all-to-all of one output row per pair back to its home rank
    sum       each token's k outputs in slot order onto the shared expert's   (ops.moe_combine_)

The last step is the single-process MoE's own combine over the same per-pair rows, so a token's
output is bitwise the same at any rank count (CPU float32, where every expert row is computed
alone by the fixed-order GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from deepinfer.engine.parallel.dispatch import check_slot_range, pack_rows, plan_dispatch, unpack_rows
from deepinfer.engine.parallel.eplb.replica_choice import (
    EVEN,
    LEAST_LOADED,
    count_pairs,
    even_replicas,
    least_loaded_replicas,
    rank_loads,
)
from deepinfer.engine.parallel.expert_slots import ExpertSlots
from deepinfer.engine.parallel.group import EpGroup
from deepinfer.engine.parallel.layer_placement import LayerPlacement
from deepinfer.kernels import ops


@dataclass(slots=True)
class EpStepState:
    """What the layers of one rank share during a step (owned by ``ExpertParallel``)."""

    num_layers: int
    num_experts: int
    sampled: bool = False  # count both replica rules' loads this step
    rules: np.ndarray = field(default=None)  # [layers] rule serving each layer
    counts: np.ndarray = field(default=None)  # [layers, experts] pairs this home rank routed this step
    loads: np.ndarray = field(default=None)  # [layers, 2] pairs this rank computed under (EVEN, LEAST_LOADED)

    def __post_init__(self):
        self.rules = np.full(self.num_layers, EVEN, dtype=np.int64)
        self.counts = np.zeros((self.num_layers, self.num_experts))
        self.loads = np.zeros((self.num_layers, 2))


class ExpertParallelMoE(nn.Module):
    """Drop-in for ``deepseek_v4.moe.MoE`` (same ``forward`` signature) holding only this
    rank's slots."""

    def __init__(self, moe: nn.Module, index: int, ep: EpGroup, placement: LayerPlacement, state: EpStepState):
        super().__init__()
        self.gate = moe.gate
        self.shared_experts = moe.shared_experts
        self.top_k = moe.top_k
        self.index = index  # position among the model's EP layers
        self.ep = ep
        self.state = state
        self.placement = placement
        experts = torch.from_numpy(placement.experts_of(ep.rank)).to(moe.experts.gate_up_proj.device)
        self.slots = ExpertSlots(moe.experts.gate_up_proj.index_select(0, experts).contiguous(),
                                 moe.experts.down_proj.index_select(0, experts).contiguous(), moe.experts.limit)
        self.num_experts = moe.experts.num_experts
        self.hidden = moe.experts.gate_up_proj.shape[2]
        check_slot_range(placement.slots_per_rank, self.slots.gate_up.dtype)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, num_tokens: int, batch_invariant: bool) -> torch.Tensor:
        """``x [R, H]``; rows >= ``num_tokens`` are padding: shared expert only."""
        plan = self.gate.forward(x, token_ids, num_tokens, batch_invariant)
        return self._run(x, plan.expert_ids, plan.weights, batch_invariant)

    def forward_idle(self) -> None:
        """This layer's exchanges with no tokens of this rank's own (it still computes what the
        other ranks send it)."""
        x = self.slots.gate_up.new_empty(0, self.hidden)
        ids = torch.empty(0, self.top_k, dtype=torch.long)
        self._run(x, ids, torch.empty(0, self.top_k), False)

    def _run(self, x, expert_ids, weights, batch_invariant):
        ep, place, state, k = self.ep, self.placement, self.state, self.top_k
        num_tokens = expert_ids.shape[0]
        pairs = count_pairs(expert_ids.cpu().numpy(), self.num_experts)
        state.counts[self.index] += pairs.per_expert
        rule = int(state.rules[self.index])
        chosen = other = None
        if rule == EVEN or state.sampled:
            chosen = even_replicas(pairs, place.logcnt, ep.rank)
        if rule == LEAST_LOADED or state.sampled:
            least = least_loaded_replicas(pairs, place.log2phy, place.logcnt, place.rank_of_slot, ep.size)
            chosen, other = (least, chosen) if rule == LEAST_LOADED else (chosen, least)
        phy = place.log2phy[pairs.expert, chosen]
        layout = plan_dispatch(place.rank_of_slot[phy], place.local_slot[phy], num_tokens, k, ep.size)
        sent = torch.zeros(ep.size, 3, dtype=torch.long)
        sent[:, 0] = torch.tensor(layout.rows_per_rank)
        sent[:, 1] = torch.tensor(layout.pairs_per_rank)
        if other is not None:
            sent[:, 2] = torch.from_numpy(rank_loads(pairs, other, place.log2phy, place.rank_of_slot, ep.size))
        got = ep.exchange_counts(sent)
        if state.sampled:
            used, alt = got[:, 1].sum().item(), got[:, 2].sum().item()
            state.loads[self.index] = (used, alt) if rule == EVEN else (alt, used)
        rows_in = got[:, 0].tolist()

        send = pack_rows(x[:num_tokens], layout)
        recv = x.new_empty(sum(rows_in), self.hidden + k)
        work = ep.all_to_all(recv, send, rows_in, layout.rows_per_rank, async_op=True)
        out = self.shared_experts.forward(x, batch_invariant) if x.shape[0] else x.new_empty(0, self.hidden)
        work.wait()
        received = unpack_rows(recv, rows_in, self.hidden)
        expected = got[:, 1].tolist()
        assert received.pairs_from_rank == expected, (
            f"layer {self.index}: pairs received {received.pairs_from_rank} differ from the counts {expected}")
        rows = self.slots.compute(received.x, received.pair_row, received.pair_slot, batch_invariant)
        combined = x.new_empty(num_tokens * k, self.hidden)
        ep.all_to_all(combined, rows, layout.pairs_per_rank, received.pairs_from_rank)
        if num_tokens == 0:
            return out
        return ops.moe_combine_(out, combined, layout.row_of_pair.to(x.device), weights)
