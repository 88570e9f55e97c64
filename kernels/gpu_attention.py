"""Sparse shared-KV MQA with the attention sink on NVIDIA GPUs (Triton): ``gathered_attention``.

torch_ref.gathered_attention gathers every token's key set (``index_select`` + ``cat``), then runs
bmm / scale / bias / sink overwrite / softmax / cast / bmm: ~10 kernels and a materialised
``[G, L + 1 + K, D]`` copy. Here one launch reads the keys in place through the row ids:

    program (token g, head block, split): q ``[BH, D]``; for each block of BN key rows of the
    token's window part (pool rows, the last id is the sink row and is skipped) then of its
    extra part (compressed rows picked by the indexer): k = rows ``[BN, D]`` (K = V),
    s = q k^T * scale + bias, online softmax, acc += p v

The sink enters as the running maximum's start value with weight 1 (``exp(sink - m)`` in the
denominator, nothing in the numerator: its row is zero). With few tokens (decode) the key blocks
are split over more programs (flash-decoding) and a second launch merges the partial maxima,
sums and accumulators; otherwise the one launch writes the output. Logits and the softmax are
float32; p is cast to the keys' dtype for the second product, as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BH = 16  # heads per program (tl.dot needs >= 16 rows)
_BN = 32  # key rows per step
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
def _attention_kernel(q_ptr, pool_ptr, prow_ptr, pbias_ptr, extra_ptr, erow_ptr, ebias_ptr, sinks_ptr, out_ptr,
                      pm_ptr, pl_ptr, pacc_ptr, H, D, L, K, scale, sq_g, sq_h, s_prow, s_pbias, s_erow, s_ebias,
                      blocks_per_split, splits, BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                      SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    g, hb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = hb * BH + tl.arange(0, BH)
    hl = h < H
    d = tl.arange(0, BD)
    dl = d < D
    kdtype = pool_ptr.dtype.element_ty
    q = tl.load(q_ptr + g.to(tl.int64) * sq_g + h[:, None] * sq_h + d[None, :], mask=hl[:, None] & dl[None, :],
                other=0.0).to(kdtype)
    sink = tl.load(sinks_ptr + h, mask=hl, other=0.0)
    # split 0 carries the sink (weight exp(sink - m)); the others start empty (finite floor, no NaNs)
    m = tl.where(sp == 0, sink, -1e30)
    l = tl.where(sp == 0, 1.0, 0.0) + tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BD], dtype=tl.float32)
    num_window = tl.cdiv(L, BN)
    num_blocks = num_window + tl.cdiv(K, BN)
    first = sp * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_blocks)
    for b in range(first, last):
        is_window = b < num_window
        j = tl.where(is_window, b, b - num_window) * BN + tl.arange(0, BN)
        wm = is_window & (j < L)
        em = (b >= num_window) & (j < K)
        row_w = tl.load(prow_ptr + g.to(tl.int64) * s_prow + j, mask=wm, other=0)
        row_e = tl.load(erow_ptr + g.to(tl.int64) * s_erow + j, mask=em, other=0)
        bias = tl.load(pbias_ptr + g.to(tl.int64) * s_pbias + j, mask=wm, other=0.0) + \
            tl.load(ebias_ptr + g.to(tl.int64) * s_ebias + j, mask=em, other=0.0)
        bias = tl.where(wm | em, bias, -float("inf"))
        k = tl.load(pool_ptr + row_w[:, None] * D + d[None, :], mask=wm[:, None] & dl[None, :], other=0.0) + \
            tl.load(extra_ptr + row_e[:, None] * D + d[None, :], mask=em[:, None] & dl[None, :], other=0.0)
        s = _dot(q, tl.trans(k), IEEE, UPCAST) * scale + bias[None, :]
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(kdtype), k, IEEE, UPCAST)
        m = m_new
    if not SPLIT:
        out = acc / l[:, None]
        dst = out_ptr + (g.to(tl.int64) * H + h[:, None]) * D + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=hl[:, None] & dl[None, :])
    else:
        at = (g.to(tl.int64) * H + h) * splits + sp
        tl.store(pm_ptr + at, m, mask=hl)
        tl.store(pl_ptr + at, l, mask=hl)
        tl.store(pacc_ptr + at[:, None] * D + d[None, :], acc, mask=hl[:, None] & dl[None, :])


@triton.jit
def _merge_kernel(pm_ptr, pl_ptr, pacc_ptr, out_ptr, D, SPLITS, SP: tl.constexpr, BD: tl.constexpr):
    gh = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    sl = s < SPLITS
    d = tl.arange(0, BD)
    dl = d < D
    m = tl.load(pm_ptr + gh * SPLITS + s, mask=sl, other=-float("inf"))
    w = tl.exp(m - tl.max(m, 0))
    den = tl.sum(w * tl.load(pl_ptr + gh * SPLITS + s, mask=sl, other=0.0), 0)
    acc = tl.load(pacc_ptr + (gh * SPLITS + s[:, None]) * D + d[None, :], mask=sl[:, None] & dl[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / den
    tl.store(out_ptr + gh * D + d, out.to(out_ptr.dtype.element_ty), mask=dl)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gathered_attention(q, pool, pool_rows, pool_bias, extra, extra_rows, extra_bias, sinks, scale,
                       batch_invariant: bool = False):
    """``torch_ref.gathered_attention``: ``[G, H, D]`` in the keys' dtype."""
    num, heads, dim = q.shape
    width = pool_rows.shape[1]
    out = torch.empty(num, heads, dim, dtype=pool.dtype, device=q.device)
    if num == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    pool = pool.contiguous()
    pool_rows, pool_bias = _rows(pool_rows), _rows(pool_bias.reshape(num, width))
    if extra is None or extra_rows is None or extra_rows.shape[1] == 0:
        extra, extra_rows, extra_bias, num_extra = pool, pool_rows, pool_bias, 0
    else:
        num_extra = extra_rows.shape[1]
        extra, extra_rows = extra.contiguous(), _rows(extra_rows)
        extra_bias = _rows(extra_bias.reshape(num, num_extra))
    num_window = width - 1  # the last pool row of each token is the sink's
    head_blocks = triton.cdiv(heads, _BH)
    num_blocks = triton.cdiv(num_window, _BN) + triton.cdiv(num_extra, _BN)
    # more programs for few tokens; batch-invariant mode keeps one order of the sums for any batch
    splits = 1 if batch_invariant else max(1, min(num_blocks, _TARGET_PROGRAMS // (num * head_blocks)))
    per_split = triton.cdiv(max(num_blocks, 1), splits)
    splits = triton.cdiv(max(num_blocks, 1), per_split)
    bd = max(16, triton.next_power_of_2(dim))
    if splits > 1:
        pm = torch.empty(num * heads * splits, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(num * heads * splits, dim, dtype=torch.float32, device=q.device)
    else:
        pm = pl = pacc = out
    _attention_kernel[(num, head_blocks, splits)](
        q, pool, pool_rows, pool_bias, extra, extra_rows, extra_bias, sinks.float().contiguous(), out, pm, pl, pacc,
        heads, dim, num_window, num_extra, float(scale), q.stride(0), q.stride(1), pool_rows.stride(0),
        pool_bias.stride(0), extra_rows.stride(0), extra_bias.stride(0), per_split, splits, BH=_BH, BN=_BN, BD=bd,
        SPLIT=splits > 1, IEEE=pool.dtype == torch.float32, UPCAST=not q.is_cuda, num_warps=8 if bd >= 256 else 4,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(num * heads,)](pm, pl, pacc, out, dim, splits, SP=triton.next_power_of_2(splits), BD=bd,
                                      num_warps=4)  # fmt: skip
    return out
