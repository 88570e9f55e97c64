"""FP8 GEMMs on NVIDIA GPUs (Triton): block-scaled E4M3 weights (kernels/fp8.py ``Fp8Weight``)
times inputs quantised on the fly, per row and 128-column group, onto FP8 tensor cores.

The numbers are kernels/fp8.py's (its ``linear_ref`` is the oracle): each 128-column group of an
input row gets the scale ``amax / 448`` and is rounded to E4M3 inside the GEMM's load of that
group (``quant_group``), each group's FP8 x FP8 product is scaled by the row's and the weight
block's scales and accumulated in float32.

    linear          x [M, K] @ weight[N, K]^T -> [M, N]
    grouped_linear  x [M, G, K], weight [G, N, K] -> [M, G, N] (block-diagonal, one launch)

Both run ``_gemm_kernel``: a program owns a tile of rows x weight rows of one group and walks K
one quantisation group (128 columns) at a time, so a group's FP8 x FP8 product on the tensor
cores is scaled and added to the float32 accumulator before the next group starts:

    acc[m, n] += (q[m, g] . data[n, g]) * s[m, g] * scale[n // 128, g]

Inside a group the tensor cores sum the 128 products themselves; on Hopper their FP8 accumulator
keeps ~13 mantissa bits (DeepGEMM's "promotion every 128" is this same scheme), so a float32
output is ~1e-4 off the oracle there (~1e-7 in the CPU interpreter, whose products are exact).
Decode (few rows) swaps the product's orientation, ``W . x^T`` as [BN, 16], so the weight rows
fill the tensor cores' long side; a deep cp.async pipeline streams the weight, the rows are
quantised in the load, and K is cut in ranges when the weight has too few column tiles to keep
the SMs streaming (float32 partial sums, added in order by ``_sum_splits_kernel``). Prefill (many rows) quantises them once first (``quantize_rows``, bitwise
the in-load form) and streams FP8 rows: quantising in the load would redo each row for every
column tile.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from deepinfer.kernels.fp8 import BLOCK, FP8_MAX, Fp8FormatError, Fp8Weight, num_blocks


@triton.jit
def to_e4m3(v, EXACT: tl.constexpr):
    """float32 ``v`` (|v| <= 448) -> float8e4nv, nearest value, ties to even. ``EXACT``: round on
    the E4M3 grid in float32 first (Triton's CPU interpreter rounds a carry into the exponent
    wrongly, 7.92 -> 4.0; the GPU's cvt.rn does it right)."""
    if EXACT:
        bits = v.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        tiny = v * 512.0 + 12582912.0  # subnormals: a multiple of 2^-9, rounded by the float add
        tiny = tl.abs((tiny - 12582912.0) * 0.001953125)
        tiny = tl.where(v < 0.0, -tiny, tiny)  # -0.0 stays negative, as the cast keeps it
        v = tl.where(tl.abs(v) < 0.015625, tiny, normal)
    return v.to(tl.float8e4nv)


@triton.jit
def quant_group(a, AXIS: tl.constexpr, EXACT: tl.constexpr):
    """``a`` float32 (zeros where masked), one 128-column group of rows along ``AXIS`` ->
    (q float8e4nv, s float32 along the other axis): s = amax / 448 and r = 448 / amax (1 where
    amax = 0), q = clamp(a * r, -448, 448) rounded to nearest (kernels/fp8.py ``quantize_rows``)."""
    amax = tl.max(tl.abs(a), axis=AXIS)
    positive = amax > 0.0
    s = tl.where(positive, tl.math.div_rn(amax, 448.0), 1.0)
    r = tl.where(positive, tl.math.div_rn(448.0, tl.where(positive, amax, 1.0)), 1.0)
    if AXIS == 1:
        q = a * r[:, None]
    else:
        q = a * r[None, :]
    q = to_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0), EXACT)
    return q, s


@triton.jit
def _quantize_rows_kernel(x_ptr, s_row, q_ptr, s_ptr, M, K, G, BR: tl.constexpr, BK: tl.constexpr,
                          EXACT: tl.constexpr):
    r, g = tl.program_id(0) * BR + tl.arange(0, BR), tl.program_id(1)
    k = g * BK + tl.arange(0, BK)
    live = (r[:, None] < M) & (k[None, :] < K)
    a = tl.load(x_ptr + r[:, None].to(tl.int64) * s_row + k[None, :], mask=live, other=0.0).to(tl.float32)
    q, s = quant_group(a, 1, EXACT)
    tl.store(q_ptr + r[:, None].to(tl.int64) * K + k[None, :], q, mask=live)
    tl.store(s_ptr + r.to(tl.int64) * G + g, s, mask=r < M)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/fp8.py ``quantize_rows`` of a 2-D ``x [M, K]``: (q [M, K] e4m3, s [M, ceil(K/128)])."""
    m, k = x.shape
    g = num_blocks(k)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, g, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    if x.stride(-1) != 1:
        x = x.contiguous()
    br = 16
    _quantize_rows_kernel[(triton.cdiv(m, br), g)](x, x.stride(0), q, s, m, k, g, BR=br, BK=BLOCK,
                                                    EXACT=not x.is_cuda, num_warps=4)
    return q, s


@triton.jit
def _gemm_kernel(x_ptr, s_row, xs_ptr, xs_row, w_ptr, ws_ptr, y_ptr, s_out, M, N, K, G, splits, per_split,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, EXACT: tl.constexpr,
                 A_FP8: tl.constexpr, PARTIAL: tl.constexpr):
    """Program (n tile, m tile, group g x split): ``y[m, g, n]`` for BM rows and BN weight rows over
    the split's ``per_split`` quantisation groups of K. x row m of group g starts at
    ``m * s_row + g * K``; ``w [G, N, K]``, ``ws [G, ceil(N/128), ceil(K/128)]``, ``y`` rows
    ``s_out`` apart. BK = 128 is both the input's quantisation group and the weight's block: one
    group per K step, and weight row n takes the scales of block row n // BK. A_FP8: x is already
    quantised (``quantize_rows``), its scales at ``xs_ptr + m * xs_row + g * groups``. PARTIAL:
    float32 partial sums go to ``y_ptr`` as [splits, M, G, N] (``_sum_splits_kernel`` adds them)."""
    nb, mb, gs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, split = (gs // splits).to(tl.int64), gs % splits
    m = mb * BM + tl.arange(0, BM)
    n = nb * BN + tl.arange(0, BN)
    ml, nl = m < M, n < N
    num_groups = tl.cdiv(K, BK)
    x_rows = x_ptr + m.to(tl.int64) * s_row + g * K
    xs_rows = xs_ptr + m.to(tl.int64) * xs_row + g * num_groups
    w_rows = w_ptr + (g * N + n) * K
    ws_rows = ws_ptr + (g * tl.cdiv(N, BK) + n // BK) * num_groups
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kg in range(split * per_split, tl.minimum(num_groups, (split + 1) * per_split)):
        k = kg * BK + tl.arange(0, BK)
        kl = k < K
        w = tl.load(w_rows[:, None] + k[None, :], mask=nl[:, None] & kl[None, :], other=0.0)
        w_scale = tl.load(ws_rows + kg, mask=nl, other=0.0)
        if SWAP:  # [BN, BK] . [BK, BM]
            a = tl.load(x_rows[None, :] + k[:, None], mask=ml[None, :] & kl[:, None], other=0.0)
            if A_FP8:
                q, s = a, tl.load(xs_rows + kg, mask=ml, other=1.0)
            else:
                q, s = quant_group(a.to(tl.float32), 0, EXACT)
            acc += tl.dot(w, q) * s[None, :] * w_scale[:, None]
        else:  # [BM, BK] . [BK, BN]
            a = tl.load(x_rows[:, None] + k[None, :], mask=ml[:, None] & kl[None, :], other=0.0)
            if A_FP8:
                q, s = a, tl.load(xs_rows + kg, mask=ml, other=1.0)
            else:
                q, s = quant_group(a.to(tl.float32), 1, EXACT)
            acc += tl.dot(q, tl.trans(w)) * s[:, None] * w_scale[None, :]
    if PARTIAL:  # this split's float32 sums, [splits, M, G, N]
        y_rows = y_ptr + (split * M + m.to(tl.int64)) * G * N + g * N
    else:
        y_rows = y_ptr + m.to(tl.int64) * s_out + g * N
    y = acc.to(y_ptr.dtype.element_ty)
    if SWAP:
        tl.store(y_rows[None, :] + n[:, None], y, mask=ml[None, :] & nl[:, None])
    else:
        tl.store(y_rows[:, None] + n[None, :], y, mask=ml[:, None] & nl[None, :])


@triton.jit
def _sum_splits_kernel(p_ptr, y_ptr, total, splits, BLOCK_SIZE: tl.constexpr):
    """``y[i] = sum over s of p[s, i]`` (float32, in split order), rounded to y's dtype."""
    i = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    live = i < total
    acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(p_ptr + s * total + i, mask=live, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=live)


_SMALL_M = 64  # up to this many rows: decode tiles
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# decode: enough programs for two waves of a 132-SM Hopper, so enough weight streams are in flight
# (a 1536 x 4096 projection is 24 column tiles of 64 rows)
_DECODE_PROGRAMS = 264


@dataclasses.dataclass(frozen=True, slots=True)
class Tiles:
    bm: int
    bn: int
    stages: int
    warps: int
    swap: bool
    splits: int = 1  # K cut in this many ranges (decode), summed by _sum_splits_kernel
    per_split: int = 1  # quantisation groups of K a split takes


def _tiles(m: int, n: int, k: int, batch_invariant: bool) -> Tiles:
    """Decode: all of the (at most 64) rows in one tile, 16 32 or 64 wide, against 64 weight rows
    (one warpgroup's wgmma M = 64 on the weight side), so each weight tile is read once, not once
    per 16 rows; 6 stages of 8 KB weight tiles in flight; K split so that the column tiles x
    splits reach ``_DECODE_PROGRAMS`` (the split depends on N and K only). Prefill: 128 x 128 tiles
    of FP8 rows and weights (32 KB a stage), 8 warps, 4 stages. Batch-invariant: always the 16-row
    decode tile (the tile shape fixes the order of a row's sums)."""
    if m <= _SMALL_M or batch_invariant:
        groups = num_blocks(k)
        wanted = max(1, min(groups, -(-_DECODE_PROGRAMS // -(-n // 64))))
        per_split = -(-groups // wanted) if groups else 1
        bm = 16 if batch_invariant else max(16, triton.next_power_of_2(m))
        return Tiles(bm, 64, 6, 4, True, max(1, -(-groups // per_split)), per_split)
    return Tiles(128, 128, 4, 8, False, 1, num_blocks(k) or 1)


def _gemm(x: torch.Tensor, weight: Fp8Weight, y: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """``y [M, G, N]`` (``[M, N]`` for a 2-D weight) from ``x``: rows of G * K values ``x.stride(0)`` apart.
    Decode tiles quantise x inside the GEMM's load; prefill tiles take it quantised once by
    ``quantize_rows`` (in the load, every column tile would quantise each row again, and the FP8
    rows are half the bytes to stream) - the same numbers either way."""
    groups = weight.shape[0] if weight.dim() == 3 else 1
    m, n, k = x.shape[0], weight.shape[-2], weight.shape[-1]
    if m == 0 or n == 0:
        return y
    t = _tiles(m, n, k, batch_invariant)
    grid = (triton.cdiv(n, t.bn), triton.cdiv(m, t.bm), groups * t.splits)
    if t.swap:
        a, a_row, scales, scales_row = x, x.stride(0), x, 0
    else:
        rows = x if x.stride(0) == groups * k else x.contiguous()
        a, scales = quantize_rows(rows.view(m * groups, k))
        a_row, scales_row = groups * k, groups * scales.shape[1]
    partial = t.splits > 1
    out = torch.empty(t.splits, m, groups, n, dtype=torch.float32, device=x.device) if partial else y
    _gemm_kernel[grid](a, a_row, scales, scales_row, weight.data, weight.scale, out, y.stride(0), m, n, k, groups,
                       t.splits, t.per_split, BM=t.bm, BN=t.bn, BK=BLOCK, SWAP=t.swap, EXACT=not x.is_cuda,
                       A_FP8=not t.swap, PARTIAL=partial, num_warps=t.warps, num_stages=t.stages)  # fmt: skip
    if partial:
        total = m * groups * n  # y is allocated contiguous by linear / grouped_linear
        _sum_splits_kernel[(triton.cdiv(total, 1024),)](out, y, total, t.splits, BLOCK_SIZE=1024, num_warps=4)
    return y


def linear(x: torch.Tensor, weight: Fp8Weight, batch_invariant: bool = False) -> torch.Tensor:
    """kernels/fp8.py ``linear_ref``: ``x [M, K]`` (float32, bfloat16 or float16) times the FP8
    ``weight [N, K]`` -> ``[M, N]`` in x's dtype."""
    _check(x, weight, 2)
    if x.shape[1] != weight.shape[1]:
        raise Fp8FormatError(f"linear: input has {x.shape[1]} columns, the FP8 weight {tuple(weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    return _gemm(x, weight, y, batch_invariant)


def grouped_linear(x: torch.Tensor, weight: Fp8Weight, batch_invariant: bool = False) -> torch.Tensor:
    """kernels/fp8.py ``grouped_linear_ref``: ``x [M, G, K]``, FP8 ``weight [G, N, K]`` -> ``[M, G, N]``
    in x's dtype (group g's rows times matrix g)."""
    _check(x, weight, 3)
    m, groups, k = x.shape
    if (groups, k) != (weight.shape[0], weight.shape[2]):
        raise Fp8FormatError(f"grouped_linear: input {tuple(x.shape)} does not fit the FP8 weight "
                             f"{tuple(weight.shape)}")
    if x.stride(2) != 1 or (groups > 1 and x.stride(1) != k):  # the kernel takes rows of G * K contiguous values
        x = x.contiguous()
    y = torch.empty(m, groups, weight.shape[1], dtype=x.dtype, device=x.device)
    return _gemm(x, weight, y, batch_invariant)


def _check(x: torch.Tensor, weight: Fp8Weight, dims: int) -> None:
    if not isinstance(weight, Fp8Weight) or weight.dim() != dims or x.dim() != dims:
        raise Fp8FormatError(f"expected a {dims}-D input and a {dims}-D Fp8Weight, got {tuple(x.shape)} and {weight!r}")
    if x.dtype not in DTYPES:
        raise Fp8FormatError(f"FP8 GEMM inputs must be float32, bfloat16 or float16, got {x.dtype}")
    if x.device != weight.device:
        raise Fp8FormatError(f"input on {x.device}, FP8 weight on {weight.device}")


assert FP8_MAX == 448.0  # quant_group's literal
