"""V4 mixture of experts: routed experts (learned top-k or hash routing) plus one shared expert.

One forward runs in four explicit stages so expert parallelism can replace the middle two:

    route     scores + expert choice per token       -> RoutePlan (ids sorted ascending)
    dispatch  (token, slot) pairs grouped by expert  -> DispatchPlan (planned on the host)
    compute   each expert's SwiGLU on its segment     -> rows in dispatch order
    combine   back to tokens, weighted sum over the token's experts, + shared expert

Dispatched rows form one buffer of per-expert segments:

    rows:  | expert e0: its pairs, padding | expert e1: its pairs, padding | ...

A segment has gemm_rows(pairs) rows in batch-invariant mode (padding rows copy token row 0 and
are never read back), so every expert GEMM takes the same kernel and a token's numbers never
depend on which other tokens share its experts; each token then sums its k experts in
ascending expert order. When padding every expert to the busiest one costs few extra rows
(decode batches where most experts are busy) all experts get segments of one size and two
batched GEMMs over all experts replace the per-expert loop; MKL gives bitwise the same rows
either way (tests/kernels checks it), so the choice never changes a token's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from deepinfer.engine.models.deepseek_v4.config import ModelConfig
from deepinfer.engine.models.deepseek_v4.layers import fuse_linears, linear_holder, release_weights
from deepinfer.kernels import cpu_gemm, cpu_native, ops
from deepinfer.kernels.fp8 import Fp8Weight, num_blocks
from deepinfer.kernels.torch_ref import gemm_rows

DENSE_ROWS_PER_CALL = 2  # measured on CPU: one per-expert GEMM call ~ two extra GEMM rows
SMALL_DISPATCH_PAIRS = 256  # below this many (token, expert) pairs plain Python beats numpy
DEVICE_DENSE_TOKENS = 64  # off the CPU, batches up to this many tokens plan on the device (no sync)
NEVER_DENSE = -(1 << 40)  # dense-layout cost that never wins: one segment per busy expert


@dataclass(slots=True)
class RoutePlan:
    expert_ids: torch.Tensor  # [T, k] ascending per token
    weights: torch.Tensor  # [T, k] float32, normalised and scaled


@dataclass(slots=True)
class DispatchPlan:
    token_of_row: torch.Tensor  # [num_rows] token index of each dispatched row (padding: 0)
    row_of_pair: torch.Tensor  # [T*k] dispatched row of pair (token * k + slot)
    segments: list[tuple[int, int, int]]  # (expert, first row, end row) per active expert
    rows_per_expert: int = 0  # > 0: dense layout, expert e owns rows [e * n, (e + 1) * n)


class Router(nn.Module):
    """``gate``: learned scores; expert choice by top-k of score + bias, or by the hash table.

    With ``image_token_id`` (V4.1 with a vision tower) tokens holding that id (image spans) choose
    their experts with their own bias ``bias_vl``; the weights stay the unbiased scores."""

    def __init__(self, config: ModelConfig, is_hash: bool, device=None, dtype=None,
                 image_token_id: int | None = None):
        super().__init__()
        self.is_hash = is_hash
        self.image_token_id = image_token_id
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
        if image_token_id is not None:
            self.register_buffer("bias_vl", torch.zeros(config.n_routed_experts, dtype=torch.float32, device=device))

    def image_rows(self, token_ids: torch.Tensor, num_tokens: int) -> torch.Tensor | None:
        """``[T]`` mask of image-span tokens, or None when they route like text. On the CPU a batch
        without image tokens gives None (checked here, no device to wait for)."""
        if self.image_token_id is None:
            return None
        mask = token_ids[:num_tokens] == self.image_token_id
        if mask.device.type == "cpu" and not bool(mask.any()):
            return None
        return mask

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, num_tokens: int, batch_invariant: bool) -> RoutePlan:
        """Route the first ``num_tokens`` rows of ``x``."""
        logits = ops.linear(x, self.weight, batch_invariant)[:num_tokens]
        hashed = self.tid2eid[token_ids[:num_tokens]] if self.is_hash else None
        bias = None if self.is_hash else self.e_score_correction_bias
        ids, weights = ops.moe_route(
            logits, bias, hashed, self.top_k, self.scoring_func, self.routed_scaling_factor, batch_invariant
        )
        image = self.image_rows(token_ids, num_tokens)
        if image is not None:  # routing is per row: each token takes the choice under its own bias
            ids_vl, weights_vl = ops.moe_route(
                logits, self.bias_vl, None, self.top_k, self.scoring_func, self.routed_scaling_factor, batch_invariant
            )
            ids = torch.where(image[:, None], ids_vl, ids)
            weights = torch.where(image[:, None], weights_vl, weights)
        return RoutePlan(expert_ids=ids, weights=weights)


class Experts(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts = e
        self.limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, device=device, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i, device=device, dtype=dtype), requires_grad=False)

    def finalize(self) -> None:
        """Per-expert transposed views, built once (a decode step loops over many experts)."""
        self.gate_up_t = [w.t() for w in self.gate_up_proj]
        self.down_t = [w.t() for w in self.down_proj]

    def quantize_fp8(self, scale_format: str) -> None:
        """Serve the experts as block-scaled FP8 (DeepSeek's checkpoints store them in FP4 or
        FP8); the dense stacks are dropped. Only ``ops.moe_experts_`` computes them then."""
        gate_up, down = (stacked_fp8(w, scale_format) for w in (self.gate_up_proj, self.down_proj))
        del self.gate_up_proj, self.down_proj, self.gate_up_t, self.down_t
        self.gate_up_proj, self.down_proj = gate_up, down

    def dense(self, rows: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        """Every expert on its own ``[E, n, H]`` rows: two batched GEMMs."""
        hidden = torch.bmm(rows, self.gate_up_proj.transpose(1, 2))
        act = ops.swiglu_clamped(hidden.view(-1, hidden.shape[-1]), self.limit, batch_invariant)
        return torch.bmm(act.view(rows.shape[0], rows.shape[1], -1), self.down_proj.transpose(1, 2))


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
        self.w_down = self.down_proj.weight.detach()  # a plain tensor (an attribute, not a second parameter)

    def quantize_fp8(self, scale_format: str) -> None:
        self.gate_up = Fp8Weight.quantize(self.gate_up, scale_format)
        self.w_down = Fp8Weight.quantize(self.w_down, scale_format)
        release_weights([self.gate_proj, self.up_proj, self.down_proj])

    def forward(self, x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        act = ops.swiglu_clamped(ops.linear(x, self.gate_up, batch_invariant), self.limit, batch_invariant)
        return ops.linear(act, self.w_down, batch_invariant)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, device=None, dtype=None, image_token_id: int | None = None):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = Router(config, config.is_hash_layer(layer), device, dtype, image_token_id)
        self.experts = Experts(config, device, dtype)
        self.shared_experts = SharedExpert(config, device, dtype)

    def finalize(self) -> None:
        self.shared_experts.finalize()
        self.experts.finalize()

    def quantize_fp8(self, scale_format: str) -> None:
        self.shared_experts.quantize_fp8(scale_format)
        self.experts.quantize_fp8(scale_format)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, num_tokens: int, batch_invariant: bool) -> torch.Tensor:
        """``x [R, H]``; rows >= ``num_tokens`` are padding: routed nowhere, shared expert only."""
        ex, gate, shared = self.experts, self.gate, self.shared_experts
        # CPU: the whole block in one native call, bitwise the native stages below (its one
        # bias serves text tokens only)
        out = None if gate.image_rows(token_ids, num_tokens) is not None else cpu_gemm.moe_forward(
            x, num_tokens, gate.weight, None if gate.is_hash else gate.e_score_correction_bias,
            gate.tid2eid if gate.is_hash else None, token_ids, self.top_k, gate.scoring_func,
            gate.routed_scaling_factor, ex.gate_up_proj, ex.down_proj, ex.limit, shared.gate_up, shared.w_down,
        )  # fmt: skip
        if out is not None:
            return out
        plan = self.gate.forward(x, token_ids, num_tokens, batch_invariant)
        if isinstance(ex.gate_up_proj, Fp8Weight) or not x.is_cpu and ops.backend_of("moe_experts_") != "torch_ref":
            # fused GPU experts: grouped GEMMs over the routed rows read only the routed experts
            # (FP8 experts: this op on every device, the torch reference on the CPU)
            out = shared.forward(x, batch_invariant)
            return ops.moe_experts_(out, x, plan.expert_ids, plan.weights, ex.gate_up_proj, ex.down_proj, ex.limit,
                                    batch_invariant)  # fmt: skip
        if cpu_gemm.usable(x, ex.gate_up_proj, ex.down_proj) and plan.expert_ids.is_cpu:
            # fixed-order native GEMMs: invariant without padded segments, one call per layer
            native = cpu_native.moe_dispatch(plan.expert_ids, ex.num_experts, False, NEVER_DENSE)
            if native is not None:
                dispatch = DispatchPlan(*native)
                rows = cpu_gemm.moe_experts(x, dispatch.token_of_row, dispatch.segments, ex.gate_up_proj,
                                            ex.down_proj, ex.limit)  # fmt: skip
                return self.combine(self.shared_experts.forward(x, batch_invariant), rows, dispatch, plan)
        dispatch = self.dispatch(plan, batch_invariant)
        rows = self.compute(x, dispatch, batch_invariant)
        return self.combine(self.shared_experts.forward(x, batch_invariant), rows, dispatch, plan)

    def dispatch(self, plan: RoutePlan, batch_invariant: bool) -> DispatchPlan:
        native = cpu_native.moe_dispatch(plan.expert_ids, self.experts.num_experts, batch_invariant, DENSE_ROWS_PER_CALL)
        if native is not None:
            return DispatchPlan(*native)
        if not plan.expert_ids.is_cpu and plan.expert_ids.shape[0] <= DEVICE_DENSE_TOKENS:
            return self._dispatch_on_device(plan, batch_invariant)
        if plan.expert_ids.numel() <= SMALL_DISPATCH_PAIRS:
            return self._dispatch_small(plan, batch_invariant)
        k, num_experts = self.top_k, self.experts.num_experts
        expert_of_pair = plan.expert_ids.reshape(-1).cpu().numpy()
        order = np.argsort(expert_of_pair, kind="stable")  # pairs grouped by expert, in pair order
        counts = np.bincount(expert_of_pair, minlength=num_experts)
        pad = gemm_rows if batch_invariant else (lambda n: n)
        busy = np.flatnonzero(counts)
        most = int(counts.max())
        loop_rows = sum(pad(int(c)) for c in counts[busy])
        # a loop iteration costs about as much as DENSE_ROWS_PER_CALL extra GEMM rows
        dense = num_experts * pad(most) <= loop_rows + DENSE_ROWS_PER_CALL * len(busy)
        experts = range(num_experts) if dense else busy.tolist()
        sizes = np.array([pad(most) if dense else pad(int(counts[e])) for e in experts])
        firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        first_of_expert = np.zeros(num_experts, dtype=np.int64)
        first_of_expert[list(experts)] = firsts
        # the j-th pair of expert e goes to row first_of_expert[e] + j; padding rows read token 0
        sorted_experts = expert_of_pair[order]
        rank = np.arange(len(order)) - (np.cumsum(counts) - counts)[sorted_experts]
        row_of_pair = np.empty(len(order), dtype=np.int64)
        row_of_pair[order] = first_of_expert[sorted_experts] + rank
        token_of_row = np.zeros(int(sizes.sum()), dtype=np.int64)
        token_of_row[row_of_pair] = np.arange(len(order)) // k
        device = plan.expert_ids.device
        segments = [(int(e), int(f), int(f + n)) for e, f, n in zip(experts, firsts, sizes)]
        return DispatchPlan(
            token_of_row=torch.from_numpy(token_of_row).to(device),
            row_of_pair=torch.from_numpy(row_of_pair).to(device),
            segments=segments,
            rows_per_expert=pad(most) if dense else 0,
        )

    def _dispatch_on_device(self, plan: RoutePlan, batch_invariant: bool) -> DispatchPlan:
        """Dense layout planned with device ops, no host round trip (GPU decode): every expert
        gets room for every token (an expert is picked at most once per token)."""
        num_tokens, k = plan.expert_ids.shape
        num_experts = self.experts.num_experts
        per = gemm_rows(num_tokens) if batch_invariant else num_tokens
        expert_of_pair = plan.expert_ids.reshape(-1)
        one_hot = torch.nn.functional.one_hot(expert_of_pair, num_experts)
        rank = (one_hot.cumsum(0) - 1).gather(1, expert_of_pair[:, None])[:, 0]  # earlier pairs of its expert
        row_of_pair = expert_of_pair * per + rank
        token_of_row = torch.zeros(num_experts * per, dtype=torch.long, device=expert_of_pair.device)
        pair_token = torch.arange(num_tokens * k, device=expert_of_pair.device) // k
        token_of_row.index_copy_(0, row_of_pair, pair_token)
        segments = [(e, e * per, (e + 1) * per) for e in range(num_experts)]
        return DispatchPlan(token_of_row=token_of_row, row_of_pair=row_of_pair, segments=segments, rows_per_expert=per)

    def _dispatch_small(self, plan: RoutePlan, batch_invariant: bool) -> DispatchPlan:
        """``dispatch`` in plain Python: the same layout, cheaper than numpy for decode batches."""
        k, num_experts = self.top_k, self.experts.num_experts
        pairs_of_expert: dict[int, list[int]] = {}
        for pair, expert in enumerate(plan.expert_ids.reshape(-1).tolist()):
            pairs_of_expert.setdefault(expert, []).append(pair)
        pad = gemm_rows if batch_invariant else (lambda n: n)
        most = max(len(p) for p in pairs_of_expert.values())
        loop_rows = sum(pad(len(p)) for p in pairs_of_expert.values())
        dense = num_experts * pad(most) <= loop_rows + DENSE_ROWS_PER_CALL * len(pairs_of_expert)
        token_of_row: list[int] = []
        row_of_pair = [0] * plan.expert_ids.numel()
        segments = []
        for expert in range(num_experts) if dense else sorted(pairs_of_expert):
            pairs = pairs_of_expert.get(expert, ())
            first = len(token_of_row)
            for i, pair in enumerate(pairs):
                row_of_pair[pair] = first + i
            token_of_row.extend(pair // k for pair in pairs)
            token_of_row.extend([0] * ((pad(most) if dense else pad(len(pairs))) - len(pairs)))
            segments.append((expert, first, len(token_of_row)))
        device = plan.expert_ids.device
        return DispatchPlan(
            token_of_row=torch.tensor(token_of_row, dtype=torch.long, device=device),
            row_of_pair=torch.tensor(row_of_pair, dtype=torch.long, device=device),
            segments=segments,
            rows_per_expert=pad(most) if dense else 0,
        )

    def compute(self, x: torch.Tensor, dispatch: DispatchPlan, batch_invariant: bool) -> torch.Tensor:
        """Expert outputs ``[num_rows, H]`` in dispatch order."""
        gathered = x.index_select(0, dispatch.token_of_row)
        ex = self.experts
        if dispatch.rows_per_expert:
            rows = gathered.view(ex.num_experts, dispatch.rows_per_expert, -1)
            return ex.dense(rows, batch_invariant).view(gathered.shape)
        sizes = [end - first for _, first, end in dispatch.segments]
        hidden = x.new_empty(gathered.shape[0], ex.gate_up_proj.shape[1])
        for (expert, _, _), rows, out in zip(dispatch.segments, gathered.split(sizes), hidden.split(sizes)):
            torch.mm(rows, ex.gate_up_t[expert], out=out)
        act = ops.swiglu_clamped(hidden, ex.limit, batch_invariant)
        result = torch.empty_like(gathered)
        for (expert, _, _), rows, out in zip(dispatch.segments, act.split(sizes), result.split(sizes)):
            torch.mm(rows, ex.down_t[expert], out=out)
        return result

    def combine(self, out: torch.Tensor, rows: torch.Tensor, dispatch: DispatchPlan, plan: RoutePlan) -> torch.Tensor:
        """Add each token's weighted expert outputs (ascending expert order) onto ``out``."""
        return ops.moe_combine_(out, rows, dispatch.row_of_pair, plan.weights)


def stacked_fp8(weights: torch.Tensor, scale_format: str) -> Fp8Weight:
    """``[E, N, K]`` -> one Fp8Weight stack, quantised a matrix at a time (no float32 twin of the
    whole stack)."""
    e, n, k = weights.shape
    data = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=weights.device)
    scale = torch.empty(e, num_blocks(n), num_blocks(k), dtype=torch.float32, device=weights.device)
    for i in range(e):
        one = Fp8Weight.quantize(weights[i], scale_format)
        data[i], scale[i] = one.data, one.scale
    return Fp8Weight(data, scale)
