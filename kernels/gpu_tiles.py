"""Triton pieces the expert GEMM kernels share (kernels/gpu_moe.py, kernels/gpu_moe_fp8.py): a
program's block of dispatch rows and column tile, the clamped SwiGLU of an up kernel's two
accumulators and the store of a tile of dispatch rows in either orientation."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dispatch_tile(bexp_ptr, tok_ptr, T, N, BM: tl.constexpr, BN: tl.constexpr):
    """Program (block b, column tile nb) of an expert GEMM over the align kernel's layout:
    (the block's expert, -1 for an unused block; its rows r [BM], their tokens, live = a real
    token; columns n [BN] and n < N)."""
    b, nb = tl.program_id(0), tl.program_id(1)
    r = b * BM + tl.arange(0, BM)
    tok = tl.load(tok_ptr + r)
    n = nb * BN + tl.arange(0, BN)
    return tl.load(bexp_ptr + b), r, tok, tok < T, n, n < N


@triton.jit
def swiglu_rounded(acc_g, acc_u, limit, dtype: tl.constexpr):
    """``swiglu_clamped`` of the gate and up sums, each rounded to ``dtype`` first (the reference
    rounds the GEMM's output before the activation), the result in ``dtype``."""
    g = tl.minimum(acc_g.to(dtype).to(tl.float32), limit)
    u = tl.minimum(tl.maximum(acc_u.to(dtype).to(tl.float32), -limit), limit)
    return (g / (1.0 + tl.exp(-g)) * u).to(dtype)


@triton.jit
def store_rows(ptr, r, n, live, nl, width, value, SWAP: tl.constexpr):
    """``value`` into rows ``r`` (``live``) and columns ``n`` (``nl``) of a ``[rows, width]`` array:
    ``value`` is ``[len(r), len(n)]``, or its transpose with SWAP."""
    if SWAP:
        tl.store(ptr + r[None, :].to(tl.int64) * width + n[:, None], value, mask=live[None, :] & nl[:, None])
    else:
        tl.store(ptr + r[:, None].to(tl.int64) * width + n[None, :], value, mask=live[:, None] & nl[None, :])
