"""FP8 block-scaled and MXFP4 weights: dequantisation for loading, quantisation for writing tests.

FP8: ``weight`` [..., N, K] float8_e4m3fn with ``scale`` [..., ceil(N/bn), ceil(K/bk)]
(float32, E8M0 ``float8_e8m0fnu``, or raw E8M0 bytes as uint8); value = weight * scale of its
block (DeepSeek's "scale_inv" convention: the stored scale multiplies).

MXFP4: ``weight`` [..., N, K/2] packed two e2m1 codes per byte (int8, uint8 or
``float4_e2m1fn_x2``), element 2j in the low nibble and 2j+1 in the high nibble, with one
E8M0 ``scale`` [..., N, K/32] per 32 consecutive values along K.

    e2m1 code:  0    1    2    3    4    5    6    7     (bit 3 = sign)
    value:      0   0.5  1.0  1.5  2.0  3.0  4.0  6.0
"""

from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0
FP4_GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP4_DTYPES = (torch.int8, torch.uint8) + ((torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ())
# Dequantise at most this many elements at a time, so a huge matrix never needs a float32 twin.
_CHUNK_ELEMENTS = 1 << 25


class QuantFormatError(ValueError):
    """A quantised weight and its scale do not fit together."""


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in _FP8_DTYPES


def is_packed_fp4(t: torch.Tensor) -> bool:
    return t.dtype in _FP4_DTYPES


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float32 multipliers from float32/bf16 scales, E8M0 scales, or raw E8M0 bytes (uint8)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """[..., N, K] FP8 weight times its per-block scale, in ``dtype``."""
    *lead, n, k = weight.shape
    bn, bk = block
    if scale.numel() == 1:  # per-tensor scale
        return (weight.to(torch.float32) * scale_to_float(scale).reshape(())).to(dtype)
    expected = (*lead, -(-n // bn), -(-k // bk))
    if tuple(scale.shape) != expected:
        raise QuantFormatError(f"scale shape {tuple(scale.shape)} does not tile weight {tuple(weight.shape)} in "
                               f"{bn}x{bk} blocks (expected {expected})")
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    w2, s2, o2 = weight.reshape(-1, n, k), scale.reshape(-1, *expected[-2:]), out.view(-1, n, k)
    rows_per_chunk = max(bn, (_CHUNK_ELEMENTS // max(k, 1)) // bn * bn)
    for i in range(w2.shape[0]):
        for r0 in range(0, n, rows_per_chunk):
            r1 = min(n, r0 + rows_per_chunk)
            s = scale_to_float(s2[i, r0 // bn: -(-r1 // bn)])
            s = s.repeat_interleave(bn, dim=0)[: r1 - r0].repeat_interleave(bk, dim=1)[:, :k]
            o2[i, r0:r1] = (w2[i, r0:r1].to(torch.float32) * s).to(dtype)
    return out


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed e2m1 codes -> [..., K] float32 values on the e2m1 grid."""
    codes = packed.contiguous().view(torch.uint8)
    # index_select, not advanced indexing: the latter is ~100x slower on CPU for this gather
    pairs = _byte_table(packed.device).index_select(0, codes.reshape(-1).long())  # (low nibble, high nibble)
    return pairs.reshape(*codes.shape[:-1], 2 * codes.shape[-1])


@functools.lru_cache(maxsize=8)
def _byte_table(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the two e2m1 values packed in each byte."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((values[byte & 0xF], values[byte >> 4]), dim=-1).to(device)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., N, K/2] packed MXFP4 weight with [..., N, K/32] E8M0 scales -> [..., N, K] in ``dtype``."""
    *lead, n, half_k = packed.shape
    k = 2 * half_k
    expected = (*lead, n, k // FP4_GROUP)
    if k % FP4_GROUP or tuple(scale.shape) != expected:
        raise QuantFormatError(f"scale shape {tuple(scale.shape)} does not fit packed FP4 weight "
                               f"{tuple(packed.shape)} (expected {expected}: one scale per {FP4_GROUP} values)")
    out = torch.empty((*lead, n, k), dtype=dtype, device=packed.device)
    p2, s2, o2 = packed.reshape(-1, n, half_k), scale.reshape(-1, n, k // FP4_GROUP), out.view(-1, n, k)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for i in range(p2.shape[0]):
        for r0 in range(0, n, rows_per_chunk):
            r1 = min(n, r0 + rows_per_chunk)
            values = unpack_fp4(p2[i, r0:r1]).view(r1 - r0, k // FP4_GROUP, FP4_GROUP)
            o2[i, r0:r1] = (values * scale_to_float(s2[i, r0:r1]).unsqueeze(-1)).view(r1 - r0, k).to(dtype)
    return out


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Dispatch on the stored dtype: FP8 blocks or packed MXFP4."""
    if is_fp8(weight):
        return dequant_fp8(weight, scale, block, dtype)
    if is_packed_fp4(weight):
        return dequant_fp4(weight, scale, dtype)
    raise QuantFormatError(f"weight dtype {weight.dtype} has a scale but is neither FP8 E4M3 nor packed FP4")


# ---- quantisation (writers of test and tiny checkpoints) --------------------------------
def _pow2_scale(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= limit (E8M0 can only hold powers of two)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / limit)))


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128), scale_fmt: str = "ue8m0"):
    """[N, K] float -> (float8_e4m3fn [N, K], scale [ceil(N/bn), ceil(K/bk)]) with per-block amax scaling."""
    n, k = weight.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.to(torch.float32)
    tiles = padded.view(nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    if scale_fmt == "ue8m0":
        scale = _pow2_scale(amax, FP8_MAX)
    else:
        scale = (amax / FP8_MAX).clamp(min=1e-30)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:n, :k]
    stored = scale.to(torch.float8_e8m0fnu) if scale_fmt == "ue8m0" else scale
    return q.to(torch.float8_e4m3fn).contiguous(), stored.contiguous()


def quantize_fp4(weight: torch.Tensor):
    """[N, K] float -> (int8 [N, K/2] packed e2m1 codes, float8_e8m0fnu [N, K/32]); round to nearest."""
    n, k = weight.shape
    if k % FP4_GROUP:
        raise QuantFormatError(f"FP4 needs the input dim to be a multiple of {FP4_GROUP}, got {k}")
    groups = weight.to(torch.float32).view(n, k // FP4_GROUP, FP4_GROUP)
    scale = _pow2_scale(groups.abs().amax(dim=-1), FP4_MAX)
    scaled = (groups / scale.unsqueeze(-1)).view(n, k)
    # nearest grid point: bucket by the midpoints between consecutive e2m1 magnitudes
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=weight.device)
    magnitude_code = torch.bucketize(scaled.abs(), midpoints)
    codes = (magnitude_code | ((scaled < 0).long() << 3)).to(torch.uint8).view(n, k // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).view(torch.int8)
    return packed.contiguous(), scale.to(torch.float8_e8m0fnu).contiguous()
