"""The routed experts' GEMMs over FP8 weights (kernels/fp8.py ``Fp8Weight``) on NVIDIA GPUs (Triton):
what kernels/gpu_moe.py's ``moe_experts_`` runs between its align and combine kernels when the
experts are FP8.

The layout is gpu_moe.py's: the align kernel's blocks of BM rows of one expert, one program per
(block, column block), the weights on the tensor cores' long side (SWAP) for decode. Each K step
is one 128-column quantisation group: the rows' tile is quantised in registers (gpu_fp8
``quant_group``, bitwise fp8.quantize_rows), multiplied FP8 x FP8 into float32 and scaled by the
rows' and the weight block's scales before it is added (the up kernel's gate and up rows share each
quantised tile), kernels/fp8.py's numbers:

    up    act[r, n] = swiglu_clamped(gate, up), both rounded to the activations' dtype first, where
          gate = sum_g (q_x[r, g] . data[e, n, g])     * s_x[r, g] * scale[e, n // 128, g]
          up   = sum_g (q_x[r, g] . data[e, I + n, g]) * s_x[r, g] * scale[e, (I + n) // 128, g]
    down  y[r, n]   = the same sum over act's rows (quantised per 128 columns of I) and down[e]

    gate_up[e] rows:  0 ........ I-1 | I ........ 2I-1
    scale rows:       |  0   |  1   |  2 ...               one per 128 rows: the up half starts
                                 ^ I (mid-block when I % 128 != 0)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import gpu_fp8
from deepinfer.kernels.fp8 import BLOCK, Fp8Weight
from deepinfer.kernels.gpu_fp8 import quant_group
from deepinfer.kernels.gpu_tiles import dispatch_tile, store_rows, swiglu_rounded


@triton.jit
def _weight_group(w_ptr, ws_ptr, n, nl, K, k0, BK: tl.constexpr):
    """Rows ``n`` of one expert's FP8 matrix (data [N, K], scale [ceil(N / BK), ceil(K / BK)]) in
    the group of columns from ``k0``: (data tile [BN, BK], the rows' weight-block scales [BN])."""
    kk = k0 + tl.arange(0, BK)
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + kk[None, :], mask=nl[:, None] & (kk < K)[None, :], other=0.0)
    ws = tl.load(ws_ptr + (n // BK) * tl.cdiv(K, BK) + k0 // BK, mask=nl, other=0.0)
    return w, ws


@triton.jit
def _group_product(q, s, w, ws, SWAP: tl.constexpr):
    """One group's FP8 x FP8 product, scaled: ``[BM, BN]``, or ``[BN, BM]`` with SWAP."""
    if SWAP:
        return tl.dot(w, q) * ws[:, None] * s[None, :]
    else:
        return tl.dot(q, tl.trans(w)) * s[:, None] * ws[None, :]


@triton.jit
def _rows_times_fp8(x_ptr, xs_ptr, tok, live, w_ptr, ws_ptr, n, n2, nl, K, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, SWAP: tl.constexpr, PAIR: tl.constexpr, EXACT: tl.constexpr,
                    A_FP8: tl.constexpr):
    """``x[tok] @ value(w)[n]^T`` over K, one 128-column group per step: ``[BM, BN]``, or its
    transpose ``[BN, BM]`` with SWAP (decode: the weight rows are the product's long side); with
    PAIR also rows ``n2`` of ``w`` (the up kernel's up half) from the same quantised tiles. A_FP8:
    x's rows are quantised already (``quantize_rows``), their scales ``ceil(K / BK)`` a row at xs."""
    if SWAP:
        acc, acc2 = tl.zeros([BN, BM], dtype=tl.float32), tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc, acc2 = tl.zeros([BM, BN], dtype=tl.float32), tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kl = kk < K
        if SWAP:
            a = tl.load(x_ptr + tok[None, :].to(tl.int64) * K + kk[:, None], mask=live[None, :] & kl[:, None],
                        other=0.0)
        else:
            a = tl.load(x_ptr + tok[:, None].to(tl.int64) * K + kk[None, :], mask=live[:, None] & kl[None, :],
                        other=0.0)
        if A_FP8:
            q, s = a, tl.load(xs_ptr + tok.to(tl.int64) * tl.cdiv(K, BK) + k0 // BK, mask=live, other=1.0)
        elif SWAP:
            q, s = quant_group(a.to(tl.float32), 0, EXACT)
        else:
            q, s = quant_group(a.to(tl.float32), 1, EXACT)
        w, ws = _weight_group(w_ptr, ws_ptr, n, nl, K, k0, BK)
        acc += _group_product(q, s, w, ws, SWAP)
        if PAIR:
            w2, ws2 = _weight_group(w_ptr, ws_ptr, n2, nl, K, k0, BK)
            acc2 += _group_product(q, s, w2, ws2, SWAP)
    return acc, acc2


@triton.jit
def _up_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, tok_ptr, bexp_ptr, act_ptr, T, H, I, limit, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, EXACT: tl.constexpr, A_FP8: tl.constexpr):
    expert, r, tok, live, n, nl = dispatch_tile(bexp_ptr, tok_ptr, T, I, BM, BN)
    if expert >= 0:
        base = w_ptr + expert.to(tl.int64) * (2 * I) * H
        scales = ws_ptr + expert * tl.cdiv(2 * I, BK) * tl.cdiv(H, BK)
        # gate rows n and up rows I + n: x's tiles quantised once for both
        acc_g, acc_u = _rows_times_fp8(x_ptr, xs_ptr, tok, live, base, scales, n, I + n, nl, H, BM, BN, BK, SWAP, True,
                                       EXACT, A_FP8)
        act = swiglu_rounded(acc_g, acc_u, limit, act_ptr.dtype.element_ty)
        store_rows(act_ptr, r, n, live, nl, I, act, SWAP)


@triton.jit
def _down_fp8_kernel(act_ptr, acts_ptr, w_ptr, ws_ptr, tok_ptr, bexp_ptr, y_ptr, T, H, I, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, EXACT: tl.constexpr, A_FP8: tl.constexpr):
    expert, r, _tok, live, n, nl = dispatch_tile(bexp_ptr, tok_ptr, T, H, BM, BN)  # act rows: the rows r
    if expert >= 0:
        base = w_ptr + expert.to(tl.int64) * H * I
        scales = ws_ptr + expert * tl.cdiv(H, BK) * tl.cdiv(I, BK)
        # act rows are dispatch rows themselves: "tokens" r
        acc, _ = _rows_times_fp8(act_ptr, acts_ptr, r, live, base, scales, n, n, nl, I, BM, BN, BK, SWAP, False, EXACT,
                                 A_FP8)
        store_rows(y_ptr, r, n, live, nl, H, acc.to(y_ptr.dtype.element_ty), SWAP)


def tiles(swap: bool, up: bool) -> tuple[int, int, int]:
    """(BN, num_stages, num_warps) beside gpu_moe's BM and SWAP; BK is one quantisation group. Decode
    keeps 48-64 KB of 8 KB weight tiles in flight (the up kernel reads two a step, gate and up: 4
    stages; down 6, as gpu_fp8's decode). Prefill streams FP8 rows, 4 stages: the up kernel's two
    [128, 64] accumulators take what registers a 128-wide tile would need (248 a thread on sm_90),
    the down kernel has one and takes 128 x 128 tiles (243)."""
    if swap:
        return 64, 4 if up else 6, 4
    return (64 if up else 128), 4, 8


def expert_rows(x, gate_up: Fp8Weight, down: Fp8Weight, tok, block_expert, t: int, limit: float, bm: int,
                swap: bool) -> torch.Tensor:
    """Each dispatch row's expert output ``down[e] @ swiglu_clamped(gate_up[e] @ x[tok])``:
    ``[len(tok), H]`` in x's dtype, rows of padding left unwritten. ``x [>= T, H]`` contiguous;
    ``tok`` / ``block_expert``: gpu_moe's align kernel's layout in blocks of ``bm`` rows."""
    if not isinstance(gate_up, Fp8Weight) or not isinstance(down, Fp8Weight):
        raise TypeError("moe_experts_: gate_up and down must both be Fp8Weight or both dense tensors, got "
                        f"{type(gate_up).__name__} and {type(down).__name__}")
    num_experts, two_i, hidden = gate_up.shape
    if tuple(down.shape) != (num_experts, hidden, two_i // 2) or x.shape[-1] != hidden:
        raise ValueError(f"moe_experts_: FP8 experts gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do "
                         f"not fit inputs of {x.shape[-1]} columns; they must be [E, 2I, H] and [E, H, I]")
    act = up_rows(x, gate_up, tok, block_expert, t, limit, bm, swap)
    return down_rows(act, down, tok, block_expert, t, bm, swap)


def _operand(rows: torch.Tensor, quantized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the GEMM's row operand, its scales): prefill tiles read rows quantised once here (each row
    feeds every column tile: quantising in the load would redo it per tile), decode tiles quantise
    in the load (the rows themselves and a placeholder for the scales)."""
    return gpu_fp8.quantize_rows(rows) if quantized else (rows, rows)


def up_rows(x, gate_up: Fp8Weight, tok, block_expert, t: int, limit: float, bm: int, swap: bool) -> torch.Tensor:
    """``swiglu_clamped(gate_up[e] @ x[tok])`` of each dispatch row: ``[len(tok), I]`` in x's dtype."""
    _, two_i, hidden = gate_up.shape
    inter = two_i // 2
    bn, stages, warps = tiles(swap, up=True)
    # prefill: zeros where no program writes (padding rows, unused blocks), as the down GEMM's
    # quantisation reads every row
    act = (torch.empty if swap else torch.zeros)(tok.shape[0], inter, dtype=x.dtype, device=x.device)
    a, scales = _operand(x[:t], not swap)
    _up_fp8_kernel[(block_expert.shape[0], triton.cdiv(inter, bn))](
        a, scales, gate_up.data, gate_up.scale, tok, block_expert, act, t, hidden, inter, float(limit), BM=bm, BN=bn,
        BK=BLOCK, SWAP=swap, EXACT=not x.is_cuda, A_FP8=not swap, num_warps=warps, num_stages=stages)  # fmt: skip
    return act


def down_rows(act, down: Fp8Weight, tok, block_expert, t: int, bm: int, swap: bool) -> torch.Tensor:
    """``down[e] @ act`` of each dispatch row: ``[len(tok), H]`` in act's dtype."""
    _, hidden, inter = down.shape
    bn, stages, warps = tiles(swap, up=False)
    rows = torch.empty(tok.shape[0], hidden, dtype=act.dtype, device=act.device)
    a, scales = _operand(act, not swap)
    _down_fp8_kernel[(block_expert.shape[0], triton.cdiv(hidden, bn))](
        a, scales, down.data, down.scale, tok, block_expert, rows, t, hidden, inter, BM=bm, BN=bn, BK=BLOCK, SWAP=swap,
        EXACT=not act.is_cuda, A_FP8=not swap, num_warps=warps, num_stages=stages)  # fmt: skip
    return rows
