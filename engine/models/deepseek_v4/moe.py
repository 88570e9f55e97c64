"""V4 mixture of experts: routed experts (learned top-k or hash routing) plus one shared expert.

One forward runs in four explicit stages so expert parallelism can replace the middle two:

    route     scores + expert choice per token       -> RoutePlan (ids sorted ascending)
    dispatch  (token, slot) pairs grouped by expert  -> DispatchPlan
    compute   each expert's SwiGLU on its rows        -> rows in dispatch order
    combine   back to tokens, weighted sum in ascending expert order, + shared expert

Batch invariance: every expert GEMM goes through ``ops.linear`` (per-row results independent of
the row count) and each token's expert outputs are summed in a fixed order, so a token's output
never depends on which other tokens share its experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.models.deepseek_v4.layers import fuse_linears, linear_holder
from deepinfer.kernels import ops


@dataclass(slots=True)
class RoutePlan:
    expert_ids: torch.Tensor  # [T, k] ascending per token
    weights: torch.Tensor  # [T, k] float32, normalised and scaled


@dataclass(slots=True)
class DispatchPlan:
    order: torch.Tensor  # [T*k] pair index (token * k + slot) in expert-major order
    token_of_row: torch.Tensor  # [T*k] token of each dispatched row
    rows_per_expert: list[int]  # [E] row counts, in expert order


class Router(nn.Module):
    """``gate``: learned scores; expert choice by top-k of score + bias, or by the hash table."""

    def __init__(self, config: ModelConfig, is_hash: bool, device=None, dtype=None):
        super().__init__()
        self.is_hash = is_hash
        self.top_k = config.num_experts_per_tok
        self.scoring_func = config.scoring_func
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(config.n_routed_experts, config.hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        if is_hash:
            self.register_buffer(
                "tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long, device=device)
            )
        else:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32, device=device)
            )

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, batch_invariant: bool) -> RoutePlan:
        logits = ops.linear(x, self.weight, batch_invariant)
        if self.scoring_func == "sqrtsoftplus":
            scores = ops.softplus(logits, batch_invariant).sqrt()
        elif self.scoring_func == "sigmoid":
            scores = ops.sigmoid(logits, batch_invariant)
        elif self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported")
        if self.is_hash:
            ids = self.tid2eid[token_ids].long()
        else:
            # the correction bias only steers the choice; weights come from the raw scores
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        ids = ids.sort(dim=-1).values
        weights = scores.gather(1, ids).float()
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return RoutePlan(expert_ids=ids, weights=weights * self.routed_scaling_factor)


class Experts(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts = e
        self.limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, device=device, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i, device=device, dtype=dtype), requires_grad=False)

    def run_expert(self, expert: int, rows: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        act = ops.swiglu_clamped(ops.linear(rows, self.gate_up_proj[expert], batch_invariant), self.limit, batch_invariant)
        return ops.linear(act, self.down_proj[expert], batch_invariant)


class SharedExpert(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        h, i = config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.gate_proj = linear_holder(h, i, device, dtype)
        self.up_proj = linear_holder(h, i, device, dtype)
        self.down_proj = linear_holder(i, h, device, dtype)
        self.gate_up: torch.Tensor | None = None

    def finalize(self) -> None:
        self.gate_up, _ = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        act = ops.swiglu_clamped(ops.linear(x, self.gate_up, batch_invariant), self.limit, batch_invariant)
        return ops.linear(act, self.down_proj.weight, batch_invariant)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, device=None, dtype=None):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = Router(config, config.is_hash_layer(layer), device, dtype)
        self.experts = Experts(config, device, dtype)
        self.shared_experts = SharedExpert(config, device, dtype)

    def finalize(self) -> None:
        self.shared_experts.finalize()

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        plan = self.gate(x, token_ids, batch_invariant)
        dispatch = self.dispatch(plan)
        rows = self.compute(x, dispatch, batch_invariant)
        return self.combine(rows, dispatch, plan) + self.shared_experts(x, batch_invariant)

    def dispatch(self, plan: RoutePlan) -> DispatchPlan:
        flat = plan.expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.experts.num_experts)
        return DispatchPlan(order=order, token_of_row=order // self.top_k, rows_per_expert=counts.tolist())

    def compute(self, x: torch.Tensor, dispatch: DispatchPlan, batch_invariant: bool) -> torch.Tensor:
        """Expert outputs ``[T*k, H]`` in dispatch (expert-major) order."""
        gathered = x.index_select(0, dispatch.token_of_row)
        outputs, start = [], 0
        for expert, n in enumerate(dispatch.rows_per_expert):
            if n:
                outputs.append(self.experts.run_expert(expert, gathered[start : start + n], batch_invariant))
                start += n
        return torch.cat(outputs) if outputs else gathered

    def combine(self, rows: torch.Tensor, dispatch: DispatchPlan, plan: RoutePlan) -> torch.Tensor:
        t, k = plan.expert_ids.shape
        per_pair = torch.empty_like(rows)
        per_pair[dispatch.order] = rows
        per_pair = per_pair.view(t, k, -1)
        weights = plan.weights.to(rows.dtype)
        out = per_pair[:, 0] * weights[:, :1]
        for slot in range(1, k):  # ascending expert id, the same order for every token
            out = out + per_pair[:, slot] * weights[:, slot : slot + 1]
        return out
