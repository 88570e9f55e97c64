"""CSA lightning-indexer scores on NVIDIA GPUs (Triton): ``index_scores``.

torch_ref.index_scores runs a bmm to ``[G, H, B]`` in the keys' dtype, then casts, relu, scales,
weights and sums over the heads: at a prefill of G = 8192 tokens, H = 64 heads and B = 2048
candidates that is several passes over a 4 GiB float32 tensor. Here one launch keeps the heads in
registers and writes only ``[G, B]``:

    program (token g, split): q[g] ``[BH, BD]`` loaded once; for each block of BN candidates of
    the split: k = keys[g, block] ``[BN, BD]``, s = q k^T ``[BH, BN]`` (float32 accumulate),
    rounded to the keys' dtype, relu(s) * Di^-0.5 * w[g, h] summed over the heads, -inf where
    the candidate is not valid

Heads and head dims are padded to powers of two of at least 16 (tl.dot's smallest tile) with
zero rows and columns, so they add nothing. Every output is one product of the full head dim,
so splitting the candidate blocks over programs (few tokens: decode) changes no number, and a
token's scores do not depend on the other tokens of the call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TARGET_PROGRAMS = 264  # two waves of the H200's 132 multiprocessors


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` with a float32 accumulator; IEEE for float32 operands (no tf32), UPCAST on the
    CPU interpreter, whose bf16 products are wrong (operands are rounded to bf16 already)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _index_kernel(q_ptr, w_ptr, k_ptr, valid_ptr, out_ptr, H, D, B, scale, sq_g, sq_h, sw_g, sk_g, sk_b, sv_g,
                  blocks_per_split, BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr,
                  UPCAST: tl.constexpr):
    g, sp = tl.program_id(0).to(tl.int64), tl.program_id(1)
    h = tl.arange(0, BH)
    hl = h < H
    d = tl.arange(0, BD)
    dl = d < D
    kdtype = k_ptr.dtype.element_ty
    q = tl.load(q_ptr + g * sq_g + h[:, None] * sq_h + d[None, :], mask=hl[:, None] & dl[None, :], other=0.0)
    w = tl.load(w_ptr + g * sw_g + h, mask=hl, other=0.0)
    first = sp * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(B, BN))
    for b in range(first, last):
        n = b * BN + tl.arange(0, BN)
        nl = n < B
        k = tl.load(k_ptr + g * sk_g + n[:, None] * sk_b + d[None, :], mask=nl[:, None] & dl[None, :], other=0.0)
        s = _dot(q.to(kdtype), tl.trans(k), IEEE, UPCAST).to(kdtype).to(tl.float32)  # [BH, BN]
        # the reference's order: relu, times the scale, times the head weight, then the head sum
        s = tl.maximum(s, 0.0) * scale
        total = tl.sum(s * w[:, None], 0)
        valid = tl.load(valid_ptr + g * sv_g + n, mask=nl, other=0)
        total = tl.where(valid != 0, total, -float("inf"))
        tl.store(out_ptr + g * B + n, total, mask=nl)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def block_n(dim: int) -> int:
    """Candidates per step: a ``[BN, BD]`` key tile of at most 8192 elements."""
    return max(16, min(64, 8192 // max(16, triton.next_power_of_2(dim))))


def index_scores(q, head_weights, keys, cand_valid, batch_invariant: bool = False):
    """``torch_ref.index_scores``: ``[G, B]`` float32, -inf where ``cand_valid`` is False."""
    num, heads, dim = q.shape
    width = keys.shape[1]
    out = torch.empty(num, width, dtype=torch.float32, device=q.device)
    if num == 0 or width == 0:
        return out
    q, keys = _rows(q), _rows(keys)
    head_weights = _rows(head_weights.float())
    valid = _rows(cand_valid).view(torch.uint8)
    bh, bn, bd = max(16, triton.next_power_of_2(heads)), block_n(dim), max(16, triton.next_power_of_2(dim))
    num_blocks = triton.cdiv(width, bn)
    # split the candidate blocks over more programs for few tokens; no number depends on it
    splits = max(1, min(num_blocks, _TARGET_PROGRAMS // num))
    per_split = triton.cdiv(num_blocks, splits)
    splits = triton.cdiv(num_blocks, per_split)
    _index_kernel[(num, splits)](
        q, head_weights, keys, valid, out, heads, dim, width, float(dim**-0.5), q.stride(0), q.stride(1),
        head_weights.stride(0), keys.stride(0), keys.stride(1), valid.stride(0), per_split,
        BH=bh, BN=bn, BD=bd, IEEE=keys.dtype == torch.float32, UPCAST=not q.is_cuda,
        num_warps=8 if bh * bd > 8192 else 4,
    )  # fmt: skip
    return out
