"""MXFP8 (OCP microscaling, E4M3 elements + UE8M0 block scales) for SWA slot rows.

One row of ``D`` values (``D % 32 == 0``) becomes ``D + D // 32`` bytes::

    packed row:  | e4m3 x0 ... x(D-1)  (D bytes) | ue8m0 s0 ... s(D/32-1)  (D/32 bytes) |
    value i   =  e4m3(x_i) * 2 ** (s_(i // 32) - 127)

so a 512-wide K=V row takes 528 bytes (ARCHITECTURE.md, "Caches"). Scale choice: the smallest power of two
``X`` with ``amax / X <= 448`` (E4M3's largest finite value), i.e. ``X = 2^ceil(log2(amax/448))``,
computed exactly from the exponent of ``amax`` (no division, no log). Unlike the OCP reference
choice ``2^(floor(log2 amax) - 8)`` nothing ever saturates; the price is at most one bit of the
block's dynamic range at the bottom.

Error bound (round to nearest): a scaled value ``v = x / X`` is either an E4M3 normal
(``|v| >= 2^-6``; 3 mantissa bits: step ``2^-3`` relative to the binade, so the error is at
most ``2^-4 * |v|``) or a subnormal (step ``2^-9``, error at most ``2^-10``). Hence::

    |x - dequant(quant(x))| <= 2^-4 * |x| + 2^-10 * X          with X <= amax / 224

Pure torch on any device (CUDA, CPU): ``torch.float8_e4m3fn`` casts round to nearest even.
A fused GPU kernel can replace these two functions behind the same byte layout.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per shared scale (OCP MX block size)
E4M3_MAX = 448.0
SCALE_BIAS = 127  # ue8m0: byte b means 2 ** (b - 127); 255 is NaN and never written
_MIN_EXP, _MAX_EXP = -127, 127


class Mxfp8Error(ValueError):
    """A row width or packed buffer that does not fit the MXFP8 layout; the message names it."""


def row_bytes(dim: int) -> int:
    """Packed bytes of one row of ``dim`` values (512 -> 528)."""
    _check_dim(dim)
    return dim + dim // BLOCK


def _check_dim(dim: int) -> None:
    if dim <= 0 or dim % BLOCK:
        raise Mxfp8Error(f"MXFP8 rows need a width that is a positive multiple of {BLOCK}, got {dim}")


def block_exponents(x: torch.Tensor) -> torch.Tensor:
    """Per-block scale exponents ``k`` (``X = 2^k``), int32 ``[..., D // 32]``."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(dim=-1)
    # amax = m * 2^e with m in [0.5, 1): amax <= 1.75 * 2^(e-1) = 448 * 2^(e-9) iff 2m <= 1.75
    mant, exp = torch.frexp(amax)
    k = torch.where(2 * mant <= 1.75, exp - 9, exp - 8)
    k = torch.where(amax > 0, k, torch.full_like(k, _MIN_EXP))  # all-zero block: any scale is exact
    return k.clamp_(_MIN_EXP, _MAX_EXP).to(torch.int32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` (any float dtype) -> (e4m3 bytes ``uint8 [..., D]``, ue8m0 ``uint8 [..., D/32]``)."""
    _check_dim(x.shape[-1])
    if not x.is_floating_point():
        raise Mxfp8Error(f"MXFP8 quantises floating-point rows, got {x.dtype}")
    k = block_exponents(x)
    scaled = x.float().unflatten(-1, (-1, BLOCK)) * torch.exp2(-k.float()).unsqueeze(-1)
    # |scaled| <= 448 by the choice of k; the clamp only guards NaN-free inputs near +-inf
    values = scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).flatten(-2)
    return values.view(torch.uint8), (k + SCALE_BIAS).to(torch.uint8)


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize``: ``[..., D]`` in ``dtype``."""
    dim = values.shape[-1]
    _check_dim(dim)
    if scales.shape[-1] * BLOCK != dim or values.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise Mxfp8Error(
            f"MXFP8 values {tuple(values.shape)}/{values.dtype} and scales {tuple(scales.shape)}/{scales.dtype} "
            f"do not match (uint8, one scale per {BLOCK} values)"
        )
    v = values.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, BLOCK))
    scale = torch.exp2(scales.float() - SCALE_BIAS).unsqueeze(-1)
    return (v * scale).flatten(-2).to(dtype)


def pack_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., D]`` -> packed ``uint8 [..., D + D/32]`` (values then scales per row), written
    into ``out`` when given (e.g. a view of a preallocated slot arena)."""
    dim = x.shape[-1]
    values, scales = quantize(x)
    if out is None:
        out = torch.empty(*x.shape[:-1], row_bytes(dim), dtype=torch.uint8, device=x.device)
    elif tuple(out.shape) != (*x.shape[:-1], row_bytes(dim)) or out.dtype != torch.uint8:
        raise Mxfp8Error(f"pack_rows: out has shape {tuple(out.shape)}/{out.dtype}, "
                         f"expected {(*x.shape[:-1], row_bytes(dim))}/torch.uint8")
    out[..., :dim].copy_(values)
    out[..., dim:].copy_(scales)
    return out


def unpack_rows(packed: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed ``uint8 [..., D + D/32]`` -> ``[..., D]`` in ``dtype``."""
    if packed.shape[-1] != row_bytes(dim) or packed.dtype != torch.uint8:
        raise Mxfp8Error(f"unpack_rows: rows of {packed.shape[-1]} {packed.dtype} bytes, expected "
                         f"{row_bytes(dim)} uint8 bytes for width {dim}")
    return dequantize(packed[..., :dim], packed[..., dim:], dtype)


def error_bound(x: torch.Tensor) -> torch.Tensor:
    """Per-element worst-case ``|x - dequant(quant(x))|`` (see the module docstring)."""
    k = block_exponents(x).float()
    scale = torch.exp2(k).repeat_interleave(BLOCK, dim=-1)
    return 2.0**-4 * x.float().abs() + 2.0**-10 * scale
