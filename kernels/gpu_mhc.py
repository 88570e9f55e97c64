"""mHC on NVIDIA GPUs (Triton): the block weights with Sinkhorn, the stream update, the head.

torch_ref.hc_pre is ~150 kernels on a GPU, ~120 of them the Sinkhorn loop on a ``[T, N, N]``
tensor (20 iterations x sum/add/divide twice); a V4 layer calls it twice. Here it is three launches:

    mixes     grid (token blocks, K chunks): partial ``flat @ fn.T`` and partial sums of squares
              over one chunk of the flattened streams (K = N * D) -> [S, T, MP], [S, T]
    finish    grid (tokens, D blocks): sum the partials, RMS scale, sigmoids, the softmax of the
              comb logits, then the collapse ``sum_n pre_n * streams_n`` of one D block (block 0
              also stores post and the softmaxed comb)
    sinkhorn  grid (tokens,), one warp each: Sinkhorn-Knopp on the N x N comb in place

The Sinkhorn has a kernel of its own because its 40 dependent reductions are latency, and they
are cheap only on a plain 2-D tile in one warp. Measured on an H200 at one token (V4 widths, in a
CUDA graph): inside the finish program (whose comb tile comes out of a 3-D partial-sum load)
15.0 us with 4 warps, 11.7 with 8, 28.4 with 1; finish without it 4.3 us plus the 1-warp kernel
3.4 us (7.7 us). One path at every batch size, so a token's comb does not depend on its batch.

RMSNorm commutes with the linear map (``linear(x * r) = r * linear(x)``), so the norm is one
scalar per token applied to the mixes. Float32 throughout, like the reference; divisions are
IEEE (``div_rn``) so the Sinkhorn iterations round as torch's do. hc_head reuses both kernels
(pre weights only). hc_post is one elementwise launch over ``[T, N, D]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 1024  # flattened-stream channels per mixes program
_CHUNK_FEW = 256  # with fewer than _BT tokens (64 programs per token at V4-Flash width)
_BK = 128
_BT = 64  # tokens per mixes program (tl.dot needs at least 16 rows)
# The mixes' tl.dot runs as 3xTF32 (tensor cores, error of float32 order). Measured on an H200
# at V4-Flash width (K = 16384, 24 mixes): 8192 tokens 2,328 us with 16 tokens x 512 channels
# per program and IEEE float32 dots -> 1,286 us with 64 x 1024 -> 355 us with 64 x 1024 in
# 3xTF32; 1024 tokens 303 -> 53 us; the relative error against float32 torch was the same in
# both precisions (1.7-2.0e-6 at 8192 tokens, 5.7-8.1e-7 at 1024).
_DOT_IEEE = False
_BD = 512  # channels per finish / post program
# Warps of a finish program (measured on an H200 at one token, without the Sinkhorn: 3.3 us with
# 1 warp, 4.3 with 4; with more tokens the collapse of a 512-channel block wants the 4).
_FINISH_WARPS = 4


@triton.jit
def _mixes_kernel(x_ptr, fn_ptr, part_ptr, ss_ptr, T, K, M, CHUNK: tl.constexpr, BK: tl.constexpr,
                  BT: tl.constexpr, MP: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr = True):
    """Partial mixes of BT tokens over one K chunk; USE_DOT=False (a few tokens): one token per
    program, products summed in registers (the tensor-core tile would be 15/16 padding)."""
    tb, s = tl.program_id(0), tl.program_id(1)
    tok = tb * BT + tl.arange(0, BT)
    m = tl.arange(0, MP)
    acc = tl.zeros([BT, MP], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(s * CHUNK, s * CHUNK + CHUNK, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + tok[:, None].to(tl.int64) * K + k[None, :], mask=(tok[:, None] < T) & (k[None, :] < K),
                    other=0.0).to(tl.float32)
        f = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        if USE_DOT:
            if IEEE:
                acc += tl.dot(x, tl.trans(f), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(f), input_precision="tf32x3")
        else:
            acc += tl.sum(x[:, None, :] * f[None, :, :], 2)
        ss += tl.sum(x * x, 1)
    live = tok < T
    tl.store(part_ptr + (s * T + tok[:, None]) * MP + m[None, :], acc, mask=live[:, None])
    tl.store(ss_ptr + s * T + tok, ss, mask=live)


@triton.jit
def _finish_kernel(part_ptr, ss_ptr, x_ptr, scale_ptr, base_ptr, comb_base_ptr, post_ptr, comb_ptr, out_ptr,
                   T, S, K, D, comb_scale, norm_eps, hc_eps, N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr,
                   SP: tl.constexpr, HEAD: tl.constexpr, BD: tl.constexpr):
    t, db = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, NP)
    lane = i < N
    grid2 = lane[:, None] & lane[None, :]
    # the S partials of this token in one 2-D / 3-D load each, summed over S
    sp = tl.arange(0, SP)
    sl = sp < S
    rows = part_ptr + (sp * T + t) * MP
    pre_mix = tl.sum(tl.load(rows[:, None] + i[None, :], mask=sl[:, None] & lane[None, :], other=0.0), 0)
    post_mix = tl.zeros([NP], dtype=tl.float32)
    comb_mix = tl.zeros([NP, NP], dtype=tl.float32)
    if not HEAD:
        post_mix = tl.sum(tl.load(rows[:, None] + N + i[None, :], mask=sl[:, None] & lane[None, :], other=0.0), 0)
        at = rows[:, None, None] + 2 * N + i[None, :, None] * N + i[None, None, :]
        comb_mix = tl.sum(tl.load(at, mask=sl[:, None, None] & grid2[None, :, :], other=0.0), 0)
    ss = tl.sum(tl.load(ss_ptr + sp * T + t, mask=sl, other=0.0), 0)
    r = tl.math.rsqrt(ss / K + norm_eps)
    if HEAD:
        pre_scale = tl.load(scale_ptr)
    else:
        pre_scale = tl.load(scale_ptr + i, mask=lane, other=0.0)
    pre = tl.sigmoid(pre_mix * r * pre_scale + tl.load(base_ptr + i, mask=lane, other=0.0)) + hc_eps
    if not HEAD:
        if db == 0:
            post_scale = tl.load(scale_ptr + N + i, mask=lane, other=0.0)
            post = tl.sigmoid(post_mix * r * post_scale + tl.load(base_ptr + N + i, mask=lane, other=0.0)) * 2
            tl.store(post_ptr + t * N + i, post, mask=lane)
            logits = comb_mix * r * comb_scale + tl.load(comb_base_ptr + i[:, None] * N + i[None, :], mask=grid2,
                                                         other=0.0)
            logits = tl.where(grid2, logits, -1e30)  # finite: padding lanes must not make NaNs
            e = tl.exp(logits - tl.max(logits, 1)[:, None])
            c = tl.where(grid2, tl.math.div_rn(e, tl.sum(e, 1)[:, None]) + hc_eps, 0.0)
            tl.store(comb_ptr + t * N * N + i[:, None] * N + i[None, :], c, mask=grid2)  # Sinkhorn: _sinkhorn_kernel
    d = db * BD + tl.arange(0, BD)
    x = tl.load(x_ptr + t.to(tl.int64) * K + i[:, None] * D + d[None, :], mask=lane[:, None] & (d[None, :] < D),
                other=0.0).to(tl.float32)
    out = tl.sum(x * pre[:, None], 0)
    tl.store(out_ptr + t.to(tl.int64) * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _post_kernel(out_ptr, x_ptr, post_ptr, comb_ptr, new_ptr, D, N: tl.constexpr, NP: tl.constexpr,
                 BD: tl.constexpr):
    t, db = tl.program_id(0), tl.program_id(1)
    k = tl.arange(0, NP)
    lane = k < N
    d = db * BD + tl.arange(0, BD)
    dl = d < D
    dtype = new_ptr.dtype.element_ty
    # the reference mixes in the streams' dtype: post and comb are rounded to it first
    post = tl.load(post_ptr + t * N + k, mask=lane, other=0.0).to(dtype).to(tl.float32)
    block = tl.load(out_ptr + t.to(tl.int64) * D + d, mask=dl, other=0.0).to(tl.float32)
    acc = post[:, None] * block[None, :]
    for j in tl.static_range(N):
        c = tl.load(comb_ptr + (t * N + j) * N + k, mask=lane, other=0.0).to(dtype).to(tl.float32)
        s = tl.load(x_ptr + (t.to(tl.int64) * N + j) * D + d, mask=dl, other=0.0).to(tl.float32)
        acc += c[:, None] * s[None, :]
    dst = new_ptr + (t.to(tl.int64) * N + k[:, None]) * D + d[None, :]
    tl.store(dst, acc.to(dtype), mask=lane[:, None] & dl[None, :])


@triton.jit
def _sinkhorn_kernel(c_ptr, out_ptr, eps, N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    grid2 = (i[:, None] < N) & (i[None, :] < N)
    at = t * N * N + i[:, None] * N + i[None, :]
    c = tl.load(c_ptr + at, mask=grid2, other=0.0).to(tl.float32)
    c = tl.math.div_rn(c, tl.sum(c, 0)[None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        c = tl.math.div_rn(c, tl.sum(c, 1)[:, None] + eps)
        c = tl.math.div_rn(c, tl.sum(c, 0)[None, :] + eps)
    tl.store(out_ptr + at, c.to(out_ptr.dtype.element_ty), mask=grid2)


def _lanes(n: int) -> int:
    """Stream lanes of a tile: a power of two, at least 2 (no degenerate 1-wide tiles)."""
    return max(2, triton.next_power_of_2(n))


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``torch_ref.sinkhorn`` on ``[T, N, N]`` (a new tensor; one program per matrix)."""
    t, n, _ = comb.shape
    out = torch.empty(comb.shape, dtype=comb.dtype, device=comb.device)
    if t == 0:
        return out
    _sinkhorn_kernel[(t,)](comb.contiguous(), out, float(eps), N=n, NP=_lanes(n), ITERS=max(1, iters),
                           num_warps=1)  # fmt: skip
    return out


def _mixes(x: torch.Tensor, fn: torch.Tensor, m: int, *, tile: tuple[int, int, int] | None = None,
           ieee: bool = _DOT_IEEE) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(partial mixes [S, T, MP], partial sums of squares [S, T], S, MP). ``tile``: (tokens per
    program, K chunk, warps) instead of the defaults (probes)."""
    t, k = x.shape
    mp = max(16, triton.next_power_of_2(m))
    few = t < _BT  # decode: one token per program, more programs over K
    chunk = _CHUNK_FEW if few else _CHUNK
    bt, warps = (1 if few else _BT), 4
    if tile is not None and not few:
        bt, chunk, warps = tile
    s = triton.cdiv(k, chunk)
    part = torch.empty(s, t, mp, dtype=torch.float32, device=x.device)
    ss = torch.empty(s, t, dtype=torch.float32, device=x.device)
    _mixes_kernel[(triton.cdiv(t, bt), s)](x, fn, part, ss, t, k, m, CHUNK=chunk, BK=chunk if few else min(_BK, chunk),
                                           BT=bt, MP=mp, USE_DOT=not few, IEEE=ieee, num_warps=warps)  # fmt: skip
    return part, ss, s, mp


def hc_pre(streams, fn, pre_post_scale, pre_post_base, comb_scale, comb_base, *, norm_eps: float, hc_eps: float,
           sinkhorn_iters: int, batch_invariant: bool = False):
    """``torch_ref.hc_pre``: (post [T, N] f32, comb [T, N, N] f32, collapsed [T, D] streams' dtype)."""
    t, n, d = streams.shape
    post = torch.empty(t, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=streams.device)
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    if t == 0:
        return post, comb, out
    x = streams.contiguous()
    if isinstance(comb_scale, torch.Tensor):
        comb_scale = float(comb_scale)
    part, ss, s, mp = _mixes(x.view(t, n * d), fn.contiguous(), (2 + n) * n)
    _finish_kernel[(t, triton.cdiv(d, _BD))](
        part, ss, x, pre_post_scale.float().contiguous(), pre_post_base.float().contiguous(),
        comb_base.float().contiguous(), post, comb, out, t, s, n * d, d, comb_scale, norm_eps, hc_eps, N=n,
        NP=_lanes(n), MP=mp, SP=triton.next_power_of_2(s), HEAD=False, BD=_BD, num_warps=_FINISH_WARPS,
    )  # fmt: skip
    _sinkhorn_kernel[(t,)](comb, comb, float(hc_eps), N=n, NP=_lanes(n), ITERS=max(1, sinkhorn_iters), num_warps=1)
    return post, comb, out


def hc_head(streams, fn, base, scale, *, norm_eps: float, hc_eps: float, batch_invariant: bool = False):
    """``torch_ref.hc_head``: ``[T, N, D]`` -> ``[T, D]``."""
    t, n, d = streams.shape
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    if t == 0:
        return out
    x = streams.contiguous()
    part, ss, s, mp = _mixes(x.view(t, n * d), fn.float().contiguous(), n)
    _finish_kernel[(t, triton.cdiv(d, _BD))](
        part, ss, x, scale.float().contiguous(), base.float().contiguous(), base, out, out, out, t, s, n * d, d,
        1.0, norm_eps, hc_eps, N=n, NP=_lanes(n), MP=mp, SP=triton.next_power_of_2(s), HEAD=True, BD=_BD,
        num_warps=_FINISH_WARPS,
    )  # fmt: skip
    return out


def hc_post(block_out, streams, post, comb, batch_invariant: bool = False):
    """``torch_ref.hc_post``: ``post_k * out + sum_j comb[j, k] * streams_j`` -> ``[T, N, D]``."""
    t, n, d = streams.shape
    new = torch.empty(t, n, d, dtype=streams.dtype, device=streams.device)
    if t == 0:
        return new
    _post_kernel[(t, triton.cdiv(d, _BD))](
        block_out.contiguous(), streams.contiguous(), post.float().contiguous(), comb.float().contiguous(), new, d,
        N=n, NP=_lanes(n), BD=_BD, num_warps=4,
    )  # fmt: skip
    return new
