"""RMSNorm and interleaved RoPE on NVIDIA GPUs (Triton), one launch each, or both in one.

torch_ref's forms cost several kernels on a GPU: ``rms_norm`` upcasts, normalises and casts back
(3), ``apply_rope_`` slices, upcasts, flips pairs, multiplies, adds and copies (~8). Here one
program normalises one row (``x [..., D]``, rows given by up to two strides, the last stride 1) in
float32 and, with ``rope_dim > 0``, rotates its trailing ``rope_dim`` channels with the tables of
``ops.rope_tables`` before the one store. Same math as the reference (float32, ``rsqrt`` of the
mean square plus eps, weight after the scale); rounding differs by float32 ulps before the cast.

Row layout: row ``i`` of ``n_outer * n_inner`` rows starts at ``(i // n_inner) * s_outer +
(i % n_inner) * s_inner`` (a 3-D view ``[R, heads, D]`` of a wider projection, a column slice of
a fused projection, or a plain contiguous tensor); the rope tables have one row per outer index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # channels per step of the row loops


@triton.jit
def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_inner, s_outer, s_inner, o_outer, o_inner, D, eps,
                          HAS_W: tl.constexpr, NORM: tl.constexpr, ROPE_DIM: tl.constexpr, HALF_P: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    outer, inner = row // n_inner, row % n_inner
    base = x_ptr + outer.to(tl.int64) * s_outer + inner.to(tl.int64) * s_inner
    dst = out_ptr + outer.to(tl.int64) * o_outer + inner.to(tl.int64) * o_inner
    scale = 1.0
    if NORM:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, D, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < D, other=0.0).to(tl.float32)
            acc += x * x
        scale = tl.math.rsqrt(tl.sum(acc, 0) / D + eps)
    plain = D - ROPE_DIM
    for start in range(0, plain, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        live = offs < plain
        y = tl.load(base + offs, mask=live, other=0.0).to(tl.float32) * scale
        if HAS_W:
            y = y * tl.load(w_ptr + offs, mask=live, other=0.0)
        tl.store(dst + offs, y.to(out_ptr.dtype.element_ty), mask=live)
    if ROPE_DIM > 0:
        # pair (2i, 2i+1) -> (x0 c0 + x1 s0, x1 c1 + x0 s1), sin signed per channel by rope_tables
        pair = tl.arange(0, HALF_P)
        live = pair < ROPE_DIM // 2
        even = plain + 2 * pair
        x0 = tl.load(base + even, mask=live, other=0.0).to(tl.float32) * scale
        x1 = tl.load(base + even + 1, mask=live, other=0.0).to(tl.float32) * scale
        if HAS_W:
            x0 = x0 * tl.load(w_ptr + even, mask=live, other=0.0)
            x1 = x1 * tl.load(w_ptr + even + 1, mask=live, other=0.0)
        table = outer.to(tl.int64) * ROPE_DIM + 2 * pair
        c0 = tl.load(cos_ptr + table, mask=live, other=0.0)
        c1 = tl.load(cos_ptr + table + 1, mask=live, other=0.0)
        s0 = tl.load(sin_ptr + table, mask=live, other=0.0)
        s1 = tl.load(sin_ptr + table + 1, mask=live, other=0.0)
        tl.store(dst + even, (x0 * c0 + x1 * s0).to(out_ptr.dtype.element_ty), mask=live)
        tl.store(dst + even + 1, (x1 * c1 + x0 * s1).to(out_ptr.dtype.element_ty), mask=live)


def _row_layout(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """(tensor, n_outer, n_inner, s_outer, s_inner) describing ``x``'s rows without a copy where
    the layout allows (last stride 1, at most one middle dim after merging), else of a copy."""
    if x.dim() == 1:
        x = x.view(1, -1)
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.reshape(x.shape[0], -1, x.shape[-1]).contiguous() if x.dim() > 1 else x.contiguous()
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0
    if x.shape[1] == 1:
        return x, x.shape[0], 1, x.stride(0), 0
    return x, x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def _launch(x, weight, eps, cos, sin, out, norm: bool) -> torch.Tensor:
    d = x.shape[-1]
    rope_dim = 0 if cos is None else cos.shape[-1]
    src, n_outer, n_inner, s_outer, s_inner = _row_layout(x)
    rows = n_outer * n_inner
    if rows == 0 or d == 0:
        return out
    if rope_dim:
        if rope_dim % 2 or rope_dim > d or cos.shape[0] != n_outer:
            raise ValueError(f"rope tables {tuple(cos.shape)} do not fit rows of {tuple(x.shape)}")
        cos, sin = cos.contiguous(), sin.contiguous()
    w = weight if weight is not None else src
    _rms_norm_rope_kernel[(rows,)](
        src, w, cos if rope_dim else src, sin if rope_dim else src, out, n_inner, s_outer, s_inner, n_inner * d, d,
        d, float(eps),
        HAS_W=weight is not None, NORM=norm, ROPE_DIM=rope_dim, HALF_P=triton.next_power_of_2(max(1, rope_dim // 2)),
        BLOCK=min(_BLOCK, triton.next_power_of_2(d)), num_warps=4 if d >= 1024 else 1,
    )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``torch_ref.rms_norm``: a new contiguous tensor of ``x``'s shape and dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _launch(x, weight, eps, None, None, out, norm=True)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope_(rms_norm(x, weight, eps), cos, sin)`` in one pass (a new tensor)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _launch(x, weight, eps, cos, sin, out, norm=True)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``torch_ref.apply_rope_`` in place on a contiguous ``x`` (others take a copy back)."""
    if not x.is_contiguous():
        y = x.contiguous()
        apply_rope_(y, cos, sin)
        x.copy_(y)
        return x
    d, rope_dim = x.shape[-1], cos.shape[-1]
    view = x.view(x.shape[0], -1, d) if x.dim() > 1 else x.view(1, 1, d)
    rows = view.shape[0] * view.shape[1]
    if rows == 0 or rope_dim == 0:
        return x
    if rope_dim % 2 or rope_dim > d or cos.shape[0] != view.shape[0]:
        raise ValueError(f"rope tables {tuple(cos.shape)} do not fit rows of {tuple(x.shape)}")
    # only the trailing rope_dim channels are touched: the row "starts" there, the plain part is empty
    tail = view[..., d - rope_dim :]
    _rms_norm_rope_kernel[(rows,)](
        tail, tail, cos.contiguous(), sin.contiguous(), tail, view.shape[1], tail.stride(0), tail.stride(1),
        tail.stride(0), tail.stride(1), rope_dim, 0.0, HAS_W=False, NORM=False, ROPE_DIM=rope_dim,
        HALF_P=triton.next_power_of_2(max(1, rope_dim // 2)),
        BLOCK=triton.next_power_of_2(rope_dim), num_warps=1,
    )  # fmt: skip
    return x
