"""Where V4.1's released numerics round, and the two ways this model can compute.

``Numerics()`` is the float path: weights dequantised exactly, every activation and cache row kept
in the compute dtype (float32 on CPU), nothing rounded on the way. ``Numerics(official=True)``
rounds where DeepSeek's inference code rounds: the KV state to the grids of the released cache
formats (so the paged and SWA rows are exactly representable in them) and the input of every
linear whose weight is FP8 or FP4 (block-scaled GEMMs multiply FP8 activations):

    window K=V rows      FP8 e4m3, one UE8M0 scale per 32 values     (528 B per 512-wide row)
    compressed rows      FP4 e2m1, one E4M3 scale per 16 values      (288 B per 512-wide row)
    indexer q and keys   FP4 e2m1, one UE8M0 scale per 32 values     (68 B per 128-wide key)
    FP8/FP4-weight input FP8 e4m3, one UE8M0 scale per 32 values     (wq_a, wkv, wq_b, wo_b,
                         indexer wq_b, experts w1/w3 and w2 (after the routing weight), Engram wkv)

Left to the compute dtype (bfloat16 on the GPU path, as released): activations between those
points and the attention probabilities (the released kernel rounds them to bfloat16 before P.V).

UE8M0 scales are powers of two, 2^ceil(log2(amax / max)); e2m1 rounds to the nearest value,
ties to the even code; e4m3 saturates at 448.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def pow2_scale(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """2^ceil(log2(amax / limit)), from the float32 bits (exact, as the released kernels do)."""
    x = (amax.float() * torch.tensor(1.0 / limit, dtype=torch.float32)).contiguous()
    bits = x.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    ceil_log2 = exponent - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((ceil_log2 + 127) << 23).view(torch.float32)


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Round ``x [..., N]`` to e4m3 with one UE8M0 scale per ``block`` values (amax floored at 1e-4)."""
    g = x.float().unflatten(-1, (-1, block))
    scale = pow2_scale(g.abs().amax(-1).clamp_min(1e-4), FP8_MAX).unsqueeze(-1)
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2).to(x.dtype)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value of ``v`` in [-6, 6], ties to the even code (0.25 -> 0, 0.75 -> 1, ...)."""
    grid = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=v.device)
    mag = v.abs()
    below = torch.bucketize(mag, grid, right=True).clamp(1, len(grid) - 1) - 1  # grid[below] <= mag
    lo, hi = grid[below], grid[below + 1]
    up = (mag - lo > hi - mag) | ((mag - lo == hi - mag) & (below % 2 == 1))  # the even code of a tie
    return torch.where(up, hi, lo).copysign(v)


def fp4_qdq(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    """Round ``x [..., N]`` to e2m1 with one scale per ``block`` values: an E4M3 scale
    (amax / 6, amax floored at 6 * 2^-9) or a UE8M0 one (amax floored at 6 * 2^-126)."""
    g = x.float().unflatten(-1, (-1, block))
    amax = g.abs().amax(-1)
    if e4m3_scale:
        scale = (amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        scale = pow2_scale(amax.clamp_min(FP4_MAX * 2.0**-126), FP4_MAX)
    v = (g / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    return (e2m1_round(v) * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)


@dataclass(frozen=True, slots=True)
class Numerics:
    official: bool = False

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """The input of a linear with an FP8/FP4 weight."""
        return fp8_qdq(x, 32) if self.official else x

    def window_kv_(self, kv: torch.Tensor) -> torch.Tensor:
        if self.official:
            kv.copy_(fp8_qdq(kv, 32))
        return kv

    def compressed_(self, rows: torch.Tensor) -> torch.Tensor:
        if self.official:
            rows.copy_(fp4_qdq(rows, 16, e4m3_scale=True))
        return rows

    def index_(self, x: torch.Tensor) -> torch.Tensor:
        if self.official:
            x.copy_(fp4_qdq(x, 32, e4m3_scale=False))
        return x
