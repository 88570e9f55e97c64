"""Mixture of experts on NVIDIA GPUs (Triton): routing, the routed experts, SwiGLU, combine.

The torch path of a decode step routes with ~10 kernels, plans a dense layout with ~10 more and
then multiplies *every* expert's weights (two batched GEMMs over all E experts): at batch 1 that
reads E / k times the weight bytes the token needs. Here:

    moe_route       one program per token: scores, top-k of score + bias (or the hash ids),
                    ids ascending, normalised weights                              (1 launch)
    moe_experts_    align (``moe_align``): the (token, slot) pairs grouped by expert into blocks
                    of BM rows (rows of an expert padded to a multiple of BM, ascending pair
                    order inside it), one program up to 8K pairs, chunks in parallel past
                    that; up: per (block, column block) x[tokens] @ W_gate/up[e]^T with the
                    SwiGLU clamp in registers; down: act @ W_down[e]^T; combine: each token
                    adds its k rows in slot order onto ``out``        (4 launches, ~8 past 8K pairs)

Blocks of unused experts are never launched with work: the align kernel marks them -1 and their
programs return at once, so only routed experts' weights are read. Row order does not change a
row's numbers (each output row is its own dot products), so the layout may depend on the batch.
Rounding follows the reference: scores and expert GEMM outputs are rounded to the activations'
dtype before the next step, accumulation is float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import gpu_moe_fp8
from deepinfer.kernels.fp8 import Fp8Weight
from deepinfer.kernels.gpu_tiles import dispatch_tile, store_rows, swiglu_rounded

SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
_SMALL_PAIRS = 1024  # up to this many (token, expert) pairs: decode tiles
ALIGN_CHUNK_PAIRS = 8192  # up to this many pairs one program lays out the rows; past it, chunks of it
# bf16 experts past _SMALL_PAIRS through torch's grouped GEMM (CUTLASS on Hopper) instead of the
# Triton tiles; the kernel tests and `deepinfer bench gpu --kernels` switch it to compare both
GROUPED_MM = hasattr(torch, "_grouped_mm")


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the CPU interpreter's bf16 products are wrong: operands are bf16-exact in float32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _route_kernel(logits_ptr, s_row, bias_ptr, hash_ptr, ids_ptr, w_ptr, E, factor, K: tl.constexpr,
                  KP: tl.constexpr, EP: tl.constexpr, MODE: tl.constexpr, HASH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    el = e < E
    dtype = logits_ptr.dtype.element_ty
    x = tl.load(logits_ptr + t * s_row + e, mask=el, other=0.0).to(tl.float32)
    if MODE == 0:  # sqrt(softplus): torch's threshold 20, log1p(exp(-|x|)) by its series when tiny
        y = tl.exp(-tl.abs(x))
        soft = tl.maximum(x, 0.0) + tl.where(y < 1e-4, y - 0.5 * y * y, tl.log(1.0 + y))
        soft = tl.where(x > 20.0, x, soft).to(dtype).to(tl.float32)
        scores = tl.sqrt_rn(soft).to(dtype).to(tl.float32)
    elif MODE == 1:
        scores = tl.sigmoid(x).to(dtype).to(tl.float32)
    else:
        z = tl.exp(tl.where(el, x, -float("inf")) - tl.max(tl.where(el, x, -float("inf")), 0))
        scores = tl.math.div_rn(z, tl.sum(z, 0)).to(dtype).to(tl.float32)
    slot = tl.arange(0, KP)
    sl = slot < K
    if HASH:
        ids = tl.load(hash_ptr + t * K + slot, mask=sl, other=0).to(tl.int32)
    else:
        v = tl.where(el, scores + tl.load(bias_ptr + e, mask=el, other=0.0), -float("inf"))
        ids = tl.zeros([KP], dtype=tl.int32)
        for i in tl.static_range(K):
            _, best = tl.max(v, 0, return_indices=True, return_indices_tie_break_left=True)
            ids = tl.where(slot == i, best.to(tl.int32), ids)
            v = tl.where(e == best, -float("inf"), v)
    # ascending ids (ties keep slot order): the rank of each slot among the k
    less = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (slot[None, :] < slot[:, None]))
    rank = tl.sum(tl.where(less & sl[None, :], 1, 0), 1)
    w = tl.sum(tl.where(ids[:, None] == e[None, :], scores[None, :], 0.0), 1)
    w = tl.where(sl, w, 0.0)
    w = tl.math.div_rn(w, tl.sum(w, 0) + 1e-20) * factor
    tl.store(ids_ptr + t * K + rank, ids.to(tl.int64), mask=sl)
    tl.store(w_ptr + t * K + rank, w, mask=sl)


@triton.jit
def _count_pairs(ids_ptr, P, lo, hi, e, BP: tl.constexpr):
    """``[EP]`` pairs of each expert among pairs ``lo .. hi`` (and < P)."""
    counts = tl.zeros(e.shape, dtype=tl.int32)
    for p0 in range(lo, hi, BP):
        p = p0 + tl.arange(0, BP)
        ex = tl.load(ids_ptr + p, mask=(p < P) & (p < hi), other=-1).to(tl.int32)
        counts += tl.sum(tl.where(ex[:, None] == e[None, :], 1, 0), 0)
    return counts


@triton.jit
def _fill_blocks(b, first, counts, tok_ptr, bexp_ptr, T, max_blocks, BM: tl.constexpr):
    """Blocks ``b [BB]``: each block's expert (-1 unused) and, in used blocks, the sentinel T in
    the padding rows past its expert's real rows (real rows are written by ``_assign_rows``)."""
    e = tl.arange(0, first.shape[0])
    padded = (counts + BM - 1) // BM * BM
    first_block, num_blocks = first // BM, padded // BM
    real_end = first + counts
    hit = (b[:, None] >= first_block[None, :]) & (b[:, None] < (first_block + num_blocks)[None, :])
    used = tl.sum(tl.where(hit, 1, 0), 1) > 0
    expert = tl.where(used, tl.sum(tl.where(hit, e[None, :], 0), 1), -1)
    tl.store(bexp_ptr + b, expert, mask=b < max_blocks)
    end = tl.sum(tl.where(hit, real_end[None, :], 0), 1)
    r = b[:, None] * BM + tl.arange(0, BM)[None, :]
    tl.store(tok_ptr + r, T + tl.zeros(r.shape, dtype=tl.int32), mask=used[:, None] & (r >= end[:, None]))


@triton.jit
def _assign_rows(ids_ptr, P, k, lo, hi, seen, e, tok_ptr, rop_ptr, BP: tl.constexpr):
    """Pairs ``lo .. hi`` (and < P) in ascending order: each takes the next row of its expert's
    segment (``seen [EP]``: the next free row of each expert at ``lo``)."""
    for p0 in range(lo, hi, BP):
        p = p0 + tl.arange(0, BP)
        pl = (p < P) & (p < hi)
        ex = tl.load(ids_ptr + p, mask=pl, other=-1).to(tl.int32)
        hot = tl.where(ex[:, None] == e[None, :], 1, 0)
        before = tl.cumsum(hot, 0) - hot  # earlier pairs of the same expert in this chunk
        row = tl.sum(tl.where(hot > 0, before + seen[None, :], 0), 1)
        tl.store(rop_ptr + p, row.to(tl.int64), mask=pl)
        tl.store(tok_ptr + row, (p // k).to(tl.int32), mask=pl)
        seen += tl.sum(hot, 0)


@triton.jit
def _align_kernel(ids_ptr, P, E, k, T, tok_ptr, rop_ptr, bexp_ptr, max_blocks, BM: tl.constexpr, EP: tl.constexpr,
                  BP: tl.constexpr, BB: tl.constexpr):
    """The whole layout in one program (few pairs: one launch)."""
    e = tl.arange(0, EP)
    counts = _count_pairs(ids_ptr, P, 0, P, e, BP)
    padded = (counts + BM - 1) // BM * BM
    first = tl.cumsum(padded, 0) - padded  # first row of each expert's segment
    for b0 in range(0, max_blocks, BB):
        _fill_blocks(b0 + tl.arange(0, BB), first, counts, tok_ptr, bexp_ptr, T, max_blocks, BM)
    _assign_rows(ids_ptr, P, k, 0, P, first, e, tok_ptr, rop_ptr, BP)


@triton.jit
def _align_count_kernel(ids_ptr, P, CH, counts_ptr, EP: tl.constexpr, BP: tl.constexpr):
    """Many pairs, step 1: program c counts the pairs of chunk c (``CH`` pairs) per expert."""
    c = tl.program_id(0)
    e = tl.arange(0, EP)
    tl.store(counts_ptr + c * EP + e, _count_pairs(ids_ptr, P, c * CH, c * CH + CH, e, BP))


@triton.jit
def _align_fill_kernel(ids_ptr, P, k, T, CH, C, counts_ptr, first_ptr, base_ptr, tok_ptr, rop_ptr, bexp_ptr,
                       max_blocks, BM: tl.constexpr, EP: tl.constexpr, BP: tl.constexpr, BB: tl.constexpr):
    """Many pairs, step 2: programs 0 .. C-1 assign the rows of their chunk's pairs (``base
    [C, EP]``: each expert's next row at the chunk's start), the rest fill BB blocks each."""
    c = tl.program_id(0)
    e = tl.arange(0, EP)
    if c < C:
        _assign_rows(ids_ptr, P, k, c * CH, c * CH + CH, tl.load(base_ptr + c * EP + e), e, tok_ptr, rop_ptr, BP)
    else:
        b = (c - C) * BB + tl.arange(0, BB)
        _fill_blocks(b, tl.load(first_ptr + e), tl.load(counts_ptr + e), tok_ptr, bexp_ptr, T, max_blocks, BM)


@triton.jit
def _rows_times_weights(x_ptr, tok, live, w_ptr, n, nl, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        SWAP: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``x[tok] @ w[n]^T`` over K: ``[BM, BN]``, or its transpose ``[BN, BM]`` with SWAP (decode:
    the weight rows are the product's long side, so the tensor cores take BN rows, not 16)."""
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kl = kk < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + kk[None, :], mask=nl[:, None] & kl[None, :], other=0.0)
        if SWAP:
            a = tl.load(x_ptr + tok[None, :].to(tl.int64) * K + kk[:, None], mask=live[None, :] & kl[:, None],
                        other=0.0)
            acc += _dot(w, a, IEEE, UPCAST)
        else:
            a = tl.load(x_ptr + tok[:, None].to(tl.int64) * K + kk[None, :], mask=live[:, None] & kl[None, :],
                        other=0.0)
            acc += _dot(a, tl.trans(w), IEEE, UPCAST)
    return acc


@triton.jit
def _up_kernel(x_ptr, w_ptr, tok_ptr, bexp_ptr, act_ptr, T, H, I, limit, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    expert, r, tok, live, n, nl = dispatch_tile(bexp_ptr, tok_ptr, T, I, BM, BN)
    if expert >= 0:
        base = w_ptr + expert.to(tl.int64) * (2 * I) * H
        acc_g = _rows_times_weights(x_ptr, tok, live, base, n, nl, H, BM, BN, BK, SWAP, IEEE, UPCAST)
        acc_u = _rows_times_weights(x_ptr, tok, live, base + I * H, n, nl, H, BM, BN, BK, SWAP, IEEE, UPCAST)
        act = swiglu_rounded(acc_g, acc_u, limit, act_ptr.dtype.element_ty)
        store_rows(act_ptr, r, n, live, nl, I, act, SWAP)


@triton.jit
def _down_kernel(act_ptr, w_ptr, tok_ptr, bexp_ptr, y_ptr, T, H, I, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    expert, r, _tok, live, n, nl = dispatch_tile(bexp_ptr, tok_ptr, T, H, BM, BN)  # act rows: the rows r
    if expert >= 0:
        base = w_ptr + expert.to(tl.int64) * H * I
        # act rows are dispatch rows themselves: "tokens" r
        acc = _rows_times_weights(act_ptr, r, live, base, n, nl, I, BM, BN, BK, SWAP, IEEE, UPCAST)
        store_rows(y_ptr, r, n, live, nl, H, acc.to(y_ptr.dtype.element_ty), SWAP)


@triton.jit
def _combine_kernel(out_ptr, s_out, rows_ptr, rop_ptr, w_ptr, H, K: tl.constexpr, BD: tl.constexpr):
    t, db = tl.program_id(0).to(tl.int64), tl.program_id(1)
    d = db * BD + tl.arange(0, BD)
    dl = d < H
    dtype = rows_ptr.dtype.element_ty
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(rop_ptr + t * K + j)
        w = tl.load(w_ptr + t * K + j).to(dtype).to(tl.float32)  # the reference weighs in the rows' dtype
        acc += w * tl.load(rows_ptr + row * H + d, mask=dl, other=0.0).to(tl.float32)
    dst = out_ptr + t * s_out + d
    tl.store(dst, (tl.load(dst, mask=dl, other=0.0).to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=dl)


@triton.jit
def _swiglu_kernel(x_ptr, s_row, out_ptr, I, limit, BD: tl.constexpr):
    t, db = tl.program_id(0).to(tl.int64), tl.program_id(1)
    d = db * BD + tl.arange(0, BD)
    dl = d < I
    g = tl.minimum(tl.load(x_ptr + t * s_row + d, mask=dl, other=0.0).to(tl.float32), limit)
    u = tl.load(x_ptr + t * s_row + I + d, mask=dl, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(out_ptr + t * I + d, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=dl)


def moe_route(logits, correction_bias, hash_ids, top_k, scoring_func, routed_scaling_factor, batch_invariant=False):
    """``torch_ref.moe_route``: (ids [T, k] int64 ascending, weights [T, k] float32)."""
    if scoring_func not in SCORING:
        raise ValueError(f"scoring_func {scoring_func!r} is not supported; use one of {tuple(SCORING)}")
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, weights
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    hashed = hash_ids is not None
    bias = logits if hashed else correction_bias.float().contiguous()
    _route_kernel[(t,)](
        logits, logits.stride(0), bias, hash_ids.contiguous() if hashed else ids, ids, weights, e,
        float(routed_scaling_factor), K=top_k, KP=triton.next_power_of_2(top_k), EP=triton.next_power_of_2(e),
        MODE=SCORING[scoring_func], HASH=hashed, num_warps=1 if e <= 256 else 4,
    )  # fmt: skip
    return ids, weights


def _tiles(pairs: int, batch_invariant: bool) -> tuple[int, int, int, int, int, bool]:
    """(BM, BN, BK, num_stages, num_warps, SWAP): 16-row blocks with the weights on the tensor
    cores' long side for decode, 128 x 64 tiles for prefill; one shape in batch-invariant mode (BK
    fixes the order of a row's sums)."""
    if pairs <= _SMALL_PAIRS or batch_invariant:
        return 16, 64, 128, 4, 4, True
    return 128, 64, 64, 3, 8, False


def moe_align(expert_ids, num_experts: int, bm: int, chunk_pairs: int | None = None):
    """The experts' row layout of ``expert_ids [T, k]``: (tok [blocks * bm] int32: the token of each
    row, T in padding rows; row_of_pair [T * k] int64; block_expert [blocks] int32, -1 unused).
    Each expert's rows are a segment padded to a multiple of ``bm``, its pairs in ascending order.
    Up to ``chunk_pairs`` (default ALIGN_CHUNK_PAIRS) pairs one program builds it; past that, chunks of ``chunk_pairs`` pairs
    are counted in parallel, a prefix over the chunks gives each its rows, and one program per
    chunk (and per 64 blocks) fills them in: the same layout, not one program walking 200K pairs."""
    t, k = expert_ids.shape
    pairs = t * k
    chunk_pairs = ALIGN_CHUNK_PAIRS if chunk_pairs is None else chunk_pairs
    max_blocks = triton.cdiv(pairs + min(num_experts, pairs) * (bm - 1), bm)
    dev = expert_ids.device
    ids = expert_ids.contiguous()
    tok = torch.empty(max_blocks * bm, dtype=torch.int32, device=dev)
    row_of_pair = torch.empty(pairs, dtype=torch.int64, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    ep = triton.next_power_of_2(num_experts)  # one [pairs, experts] tile of BP x EP in registers
    bp, bb = max(16, 4096 // ep), 64
    if pairs <= chunk_pairs:
        _align_kernel[(1,)](ids, pairs, num_experts, k, t, tok, row_of_pair, block_expert, max_blocks,
                            BM=bm, EP=ep, BP=bp, BB=bb, num_warps=4)  # fmt: skip
        return tok, row_of_pair, block_expert
    chunk = triton.cdiv(chunk_pairs, bp) * bp
    num_chunks = triton.cdiv(pairs, chunk)
    chunk_counts = torch.empty(num_chunks, ep, dtype=torch.int32, device=dev)
    _align_count_kernel[(num_chunks,)](ids, pairs, chunk, chunk_counts, EP=ep, BP=bp, num_warps=4)
    counts = chunk_counts.sum(0, dtype=torch.int32)
    padded = (counts + bm - 1) // bm * bm
    first = (torch.cumsum(padded, 0, dtype=torch.int32) - padded).contiguous()
    base = (first + torch.cumsum(chunk_counts, 0, dtype=torch.int32) - chunk_counts).contiguous()
    grid = num_chunks + triton.cdiv(max_blocks, bb)
    _align_fill_kernel[(grid,)](ids, pairs, k, t, chunk, num_chunks, counts.contiguous(), first, base, tok, row_of_pair,
                                block_expert, max_blocks, BM=bm, EP=ep, BP=bp, BB=bb, num_warps=4)  # fmt: skip
    return tok, row_of_pair, block_expert


def moe_experts_(out, x, expert_ids, weights, gate_up, down, limit: float, batch_invariant: bool = False):
    """``out[t] += sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for the first T rows (T = len(ids));
    expert e is ``down[e] @ swiglu_clamped(gate_up[e] @ x)``; returns ``out``. Experts of ``Fp8Weight``
    run gpu_moe_fp8's kernels (kernels/fp8.py's numbers) between the same align and combine."""
    t, k = expert_ids.shape
    if t == 0:
        return out
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    pairs = t * k
    bm, bn, bk, stages, warps, swap = _tiles(pairs, batch_invariant)
    tok, row_of_pair, block_expert = moe_align(expert_ids, num_experts, bm)
    max_blocks = block_expert.numel()
    dev = x.device
    x = x.contiguous()
    if isinstance(gate_up, Fp8Weight) or isinstance(down, Fp8Weight):
        rows = gpu_moe_fp8.expert_rows(x, gate_up, down, tok, block_expert, t, limit, bm, swap)
        return moe_combine_(out, rows, row_of_pair, weights)
    if _grouped_usable(x, gate_up, down, swap):
        return moe_combine_(out, _grouped_rows(x, gate_up, down, tok, block_expert, t, limit, bm), row_of_pair,
                            weights)  # fmt: skip
    act = torch.empty(max_blocks * bm, inter, dtype=x.dtype, device=dev)
    flags = dict(SWAP=swap, IEEE=x.dtype == torch.float32, UPCAST=not x.is_cuda, num_warps=warps, num_stages=stages)
    _up_kernel[(max_blocks, triton.cdiv(inter, bn))](x, gate_up.contiguous(), tok, block_expert, act, t, hidden, inter,
                                                     float(limit), BM=bm, BN=bn, BK=bk, **flags)  # fmt: skip
    rows = torch.empty(max_blocks * bm, hidden, dtype=x.dtype, device=dev)
    _down_kernel[(max_blocks, triton.cdiv(hidden, bn))](act, down.contiguous(), tok, block_expert, rows, t, hidden,
                                                        inter, BM=bm, BN=bn, BK=bk, **flags)  # fmt: skip
    return moe_combine_(out, rows, row_of_pair, weights)


def _grouped_usable(x, gate_up, down, decode_tiles: bool) -> bool:
    """Prefill-sized bf16 experts where torch has a grouped GEMM for them (sm90 and sm100 on
    CUDA, the two its CUTLASS kernels are built for; its reference loop on the CPU, where only
    the interpreted kernel tests get here) and the widths keep its rows 16-byte aligned."""
    if decode_tiles or not GROUPED_MM or not all(w.dtype == torch.bfloat16 for w in (x, gate_up, down)):
        return False
    if gate_up.shape[-1] % 8 or down.shape[-1] % 8:
        return False
    return not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] in (9, 10)


def _grouped_rows(x, gate_up, down, tok, block_expert, t: int, limit: float, bm: int):
    """The experts' output rows of the align's layout through ``torch._grouped_mm``: the rows of
    ``x`` gathered into the layout (padding rows repeat a real token: their outputs are never
    combined), gate/up as one grouped GEMM (output rounded to bf16, as the reference's linear
    is), the clamped SwiGLU, down as another. Expert e's group is its used blocks: the layout
    puts the experts' segments in ascending order from row 0, so the group ends are the running
    sum of each expert's blocks, computed on the device (no host sync)."""
    num_experts = gate_up.shape[0]
    used = (block_expert >= 0).to(torch.int32)
    blocks = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    blocks.scatter_add_(0, block_expert.clamp(min=0).long(), used)
    ends = (torch.cumsum(blocks, 0, dtype=torch.int32) * bm).to(torch.int32)
    rows_in = x.index_select(0, tok.clamp(0, t - 1))  # unused blocks' rows are never written by the align
    hidden = torch._grouped_mm(rows_in, gate_up.transpose(1, 2), offs=ends)
    act = swiglu_clamped(hidden, limit)
    return torch._grouped_mm(act, down.transpose(1, 2), offs=ends)


def moe_combine_(out, rows, row_of_pair, weights):
    """``torch_ref.moe_combine_``: ``out[t] += sum_j weights[t, j] * rows[row_of_pair[t * k + j]]``."""
    t, k = weights.shape
    if t == 0:
        return out
    h = rows.shape[-1]
    if out.stride(-1) != 1 or rows.stride(-1) != 1 or rows.stride(0) != h:
        raise ValueError("moe_combine_: out and rows need contiguous rows")
    bd = min(1024, triton.next_power_of_2(h))
    _combine_kernel[(t, triton.cdiv(h, bd))](out, out.stride(0), rows, row_of_pair.contiguous(),
                                             weights.float().contiguous(), h, K=k, BD=bd, num_warps=4)  # fmt: skip
    return out


def swiglu_clamped(gate_up, limit: float, batch_invariant: bool = False):
    """``torch_ref.swiglu_clamped`` on rows ``[..., 2I]`` -> ``[..., I]``."""
    two_i = gate_up.shape[-1]
    x = gate_up.reshape(-1, two_i)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, inter = x.shape[0], two_i // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or inter == 0:
        return out
    bd = min(1024, triton.next_power_of_2(inter))
    _swiglu_kernel[(rows, triton.cdiv(inter, bd))](x, x.stride(0), out, inter, float(limit), BD=bd, num_warps=4)
    return out
