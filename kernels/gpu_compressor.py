"""A gated compressor's entries on NVIDIA GPUs (Triton): ``compress_pool``.

torch_ref's form (kernels/compress_ref.py, then ``rms_norm``) costs ~14 launches and copies the
pools: index_selects, cats, slices, bias adds, masked_fill, softmax, casts, product, sum, norm.
Here one program builds one entry, the whole ``head_dim`` row in registers, reading every source
row where it lies (no pool copy):

    pool row i  = ring[ring_rows[i]]   for i < len(ring_rows)
                = fresh[i - len(ring_rows)]   otherwise

    pass 1, over blocks of BS slots: gate + bias (float32), -inf where the slot is invalid;
            running max m and sum l of exp(gate - m) per channel
    pass 2, same blocks: weight = exp(gate - m) / l rounded to kv's dtype, times kv rounded to
            kv's dtype, summed in float32; the sum rounded to kv's dtype, then RMSNorm in float32
            (float32 weight) and one store in kv's dtype

The roundings are the reference's: float32 softmax, weights and products in kv's dtype, the sum
in float32 rounded once (torch's sum of a bf16 tensor), the norm as torch_ref.rms_norm. Only the
float32 summation orders (and the online softmax's rescaling) differ: float32 ulps before a
rounding. An entry with no valid slot is NaN, as torch's softmax of
all -inf is (m = -inf makes exp(gate - m) NaN); the planner never builds one (each entry's own
window is at or past the window floor). Invalid slots are never read: their weight is 0, so
only a non-finite value there (the reference would give NaN) could tell the difference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TILE = 4096  # elements of one [BS, DP] block of slots: 32 per thread of 4 warps


@triton.jit
def _slots(idx_ptr, valid_ptr, rrows_ptr, e, j, span, ratio, num_ring, OVERLAP: tl.constexpr):
    """Slots ``j [BS]`` of entry ``e``: (ring row, fresh row, is_ring, valid, half: 1 where the
    slot reads the second half of its row, j >= ratio with OVERLAP)."""
    is_slot = j < span
    idx = tl.load(idx_ptr + e * span + j, mask=is_slot, other=0).to(tl.int64)
    valid = (tl.load(valid_ptr + e * span + j, mask=is_slot, other=0) != 0) & is_slot
    is_ring = idx < num_ring
    ring_row = tl.load(rrows_ptr + idx, mask=is_slot & is_ring, other=0).to(tl.int64)
    if OVERLAP:
        half = (j >= ratio).to(tl.int32)
    else:
        half = tl.zeros(j.shape, dtype=tl.int32)
    return ring_row, idx - num_ring, is_ring, valid, half


@triton.jit
def _rows(fresh_ptr, ring_ptr, fresh_row, ring_row, is_ring, col, mask, s_fresh, s_ring):
    """``[BS, DP]`` values at ``col`` of each slot's row, read from the ring or the fresh rows
    (two masked loads: a select of pointers would cost the vector loads)."""
    from_ring = tl.load(ring_ptr + (ring_row * s_ring)[:, None] + col, mask=mask & is_ring[:, None], other=0.0)
    fresh = tl.load(fresh_ptr + (fresh_row * s_fresh)[:, None] + col, mask=mask & ~is_ring[:, None], other=0.0)
    return tl.where(is_ring[:, None], from_ring, fresh)


@triton.jit
def _block(idx_ptr, valid_ptr, rrows_ptr, gate_ptr, rgate_ptr, bias_ptr, e, j, c, is_chan, span, ratio, num_ring, D,
           s_gate, s_rgate, s_bias, OVERLAP: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Slots ``j`` of entry ``e``: their rows (as ``_slots``), the channel columns ``col`` they
    read, and gate + bias ``[BS, DP]`` in float32, -inf for invalid and padded slots; padded
    channels stay finite (0) so their unused sums cannot turn into NaN."""
    ring_row, fresh_row, is_ring, valid, half = _slots(idx_ptr, valid_ptr, rrows_ptr, e, j, span, ratio, num_ring,
                                                       OVERLAP)
    col = (half * D)[:, None] + c[None, :]
    live = valid[:, None] & is_chan
    g = _rows(gate_ptr, rgate_ptr, fresh_row, ring_row, is_ring, col, live, s_gate, s_rgate).to(tl.float32)
    if HAS_BIAS:
        g += tl.load(bias_ptr + ((j - half * ratio) * s_bias)[:, None] + col, mask=live, other=0.0)
    return ring_row, fresh_row, is_ring, valid, col, tl.where(valid[:, None] | ~is_chan, g, -float("inf"))


@triton.jit
def _compress_kernel(kv_ptr, gate_ptr, rkv_ptr, rgate_ptr, rrows_ptr, idx_ptr, valid_ptr, bias_ptr, w_ptr, out_ptr,
                     num_ring, span, ratio, D, s_kv, s_gate, s_rkv, s_rgate, s_bias, eps,
                     OVERLAP: tl.constexpr, HAS_BIAS: tl.constexpr, BS: tl.constexpr, DP: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, DP)
    is_chan = (c < D)[None, :]
    kdtype = out_ptr.dtype.element_ty
    # pass 1: per channel, the max m and sum l of exp(gate - m) over the span (online)
    m = tl.full([DP], -float("inf"), tl.float32)
    l = tl.zeros([DP], dtype=tl.float32)
    for start in range(0, span, BS):
        _, _, _, _, _, g = _block(  # (Triton takes no starred targets)
            idx_ptr, valid_ptr, rrows_ptr, gate_ptr, rgate_ptr, bias_ptr, e, start + tl.arange(0, BS), c, is_chan, span,
            ratio, num_ring, D, s_gate, s_rgate, s_bias, OVERLAP, HAS_BIAS)
        m_new = tl.maximum(m, tl.max(g, 0))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # no slot valid yet: l stays 0
        l = l * tl.exp(m - shift) + tl.sum(tl.exp(g - shift[None, :]), 0)
        m = m_new
    # pass 2: rounded weights times kv, summed in float32
    acc = tl.zeros([DP], dtype=tl.float32)
    for start in range(0, span, BS):
        ring_row, fresh_row, is_ring, valid, col, g = _block(
            idx_ptr, valid_ptr, rrows_ptr, gate_ptr, rgate_ptr, bias_ptr, e, start + tl.arange(0, BS), c, is_chan, span,
            ratio, num_ring, D, s_gate, s_rgate, s_bias, OVERLAP, HAS_BIAS)
        weight = (tl.exp(g - m[None, :]) / l[None, :]).to(kdtype).to(tl.float32)
        x = _rows(kv_ptr, rkv_ptr, fresh_row, ring_row, is_ring, col, valid[:, None] & is_chan, s_kv, s_rkv)
        acc += tl.sum((x.to(tl.float32) * weight).to(kdtype).to(tl.float32), 0)
    # RMSNorm of the pooled row rounded to kv's dtype, as torch_ref.rms_norm
    live = c < D
    pooled = tl.where(live, acc.to(kdtype).to(tl.float32), 0.0)
    scale = tl.math.rsqrt(tl.sum(pooled * pooled, 0) / D + eps)
    w = tl.load(w_ptr + c, mask=live, other=0.0)
    tl.store(out_ptr + e * D + c, (pooled * scale * w).to(kdtype), mask=live)


def _strided_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def tiles(head_dim: int, span: int) -> tuple[int, int, int]:
    """(BS slots per block, DP padded channels, warps) of an entry's program."""
    dp = triton.next_power_of_2(head_dim)
    bs = max(1, min(triton.next_power_of_2(span), _TILE // dp))
    return bs, dp, 4 if bs * dp >= 2048 else 1


def compress_pool(kv, gate, ring_kv, ring_gate, ring_rows, src_index, src_valid, position_bias, ratio: int,
                  head_dim: int, overlap: bool, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch_ref.compress_pool``: ``[E, head_dim]`` in kv's dtype (shapes in kernels/compress_ref.py)."""
    num_entries, span = src_index.shape
    width = 2 * head_dim if overlap else head_dim
    if kv.shape[-1] != width or (overlap and span != 2 * ratio):
        raise ValueError(f"rows of width {kv.shape[-1]} and span {span} do not fit ratio {ratio}, head_dim "
                         f"{head_dim}, overlap {overlap}")
    if position_bias is not None and (tuple(position_bias.shape) != (ratio, width) or (not overlap and span != ratio)):
        raise ValueError(f"position_bias {tuple(position_bias.shape)} does not fit ratio {ratio}, span {span}")
    out = torch.empty(num_entries, head_dim, dtype=kv.dtype, device=kv.device)
    if num_entries == 0:
        return out
    kv, gate, ring_kv, ring_gate = (_strided_rows(t) for t in (kv, gate, ring_kv, ring_gate))
    bias = position_bias.float().contiguous() if position_bias is not None else kv
    bs, dp, warps = tiles(head_dim, span)
    _compress_kernel[(num_entries,)](
        kv, gate, ring_kv, ring_gate, ring_rows.contiguous(), src_index.contiguous(),
        src_valid.contiguous().view(torch.uint8), bias, norm_weight.float().contiguous(), out,
        ring_rows.numel(), span, ratio, head_dim, kv.stride(0), gate.stride(0), ring_kv.stride(0), ring_gate.stride(0),
        bias.stride(0), float(eps), OVERLAP=overlap, HAS_BIAS=position_bias is not None, BS=bs, DP=dp,
        num_warps=warps,
    )  # fmt: skip
    return out
