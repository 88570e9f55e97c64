"""V4's MoE with the released FP8 activation rounding (``Numerics(official=True)``).

The router reads the block input as it is; each expert (routed and shared) reads it rounded to
FP8 (its w1/w3 are FP8/FP4), and its w2 reads the SwiGLU output rounded to FP8 after the routing
weight is applied, as the released code orders it. The float path keeps V4's MoE unchanged.
"""

from __future__ import annotations

import torch

from deepinfer.engine.models.deepseek_v4.moe import MoE
from deepinfer.engine.models.deepseek_v41.numerics import fp8_qdq
from deepinfer.kernels import ops


class OfficialMoE(MoE):
    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, num_tokens: int, batch_invariant: bool) -> torch.Tensor:
        bi, t = batch_invariant, num_tokens
        plan = self.gate.forward(x, token_ids, num_tokens, bi)
        ex, sh = self.experts, self.shared_experts
        xq = fp8_qdq(x)
        act = ops.swiglu_clamped(ops.linear(xq, sh.gate_up, bi), sh.limit, bi)
        out = ops.linear(fp8_qdq(act), sh.down_proj.weight, bi)
        routed = torch.zeros_like(out[:t])
        for expert in plan.expert_ids.unique().tolist():
            rows, slot = (plan.expert_ids == expert).nonzero(as_tuple=True)
            hidden = ops.swiglu_clamped(xq.index_select(0, rows) @ ex.gate_up_t[expert], ex.limit, bi)
            weighted = fp8_qdq(hidden * plan.weights[rows, slot, None].to(hidden.dtype))
            routed.index_add_(0, rows, weighted @ ex.down_t[expert])
        out[:t] += routed
        return out
