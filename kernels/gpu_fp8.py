"""FP8 GEMMs on NVIDIA GPUs (Triton): block-scaled E4M3 weights (kernels/fp8.py ``Fp8Weight``)
times inputs quantised on the fly, per row and 128-column group, onto FP8 tensor cores.

The numbers are kernels/fp8.py's (its ``linear_ref`` is the oracle): each 128-column group of an
input row gets the scale ``amax / 448`` and is rounded to E4M3 inside the GEMM's load of that
group (``quant_group``), each group's FP8 x FP8 product is scaled by the row's and the weight
block's scales and accumulated in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels.fp8 import BLOCK, FP8_MAX, num_blocks


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
    (q float8e4nv, s float32 along the other axis): s = amax / 448 (1 where amax = 0),
    q = clamp(a / s, -448, 448) rounded to nearest (kernels/fp8.py ``quantize_rows``)."""
    amax = tl.max(tl.abs(a), axis=AXIS)
    s = tl.where(amax > 0.0, tl.math.div_rn(amax, 448.0), 1.0)
    if AXIS == 1:
        q = tl.math.div_rn(a, s[:, None])
    else:
        q = tl.math.div_rn(a, s[None, :])
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


assert FP8_MAX == 448.0  # quant_group's literal
