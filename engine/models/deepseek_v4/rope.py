"""Inverse frequencies of V4's two rotary embeddings.

"main" (plain RoPE, theta 10000) serves window-only layers; "compress" (theta 160000, YaRN in
the released checkpoints) serves compressed layers: their queries/keys, the compressed entries
(at the position of their window's first source token) and the indexer. Only the trailing
``qk_rope_head_dim`` channels rotate, in interleaved pairs. V4 never scales cos/sin by YaRN's
attention factor.
"""

from __future__ import annotations

import math

import torch

from deepinfer.engine.models.deepseek_v4.config import RopeConfig


def inv_freq(rope: RopeConfig, rope_dim: int) -> torch.Tensor:
    """``[rope_dim // 2]`` float32 inverse frequencies for ``rope`` ("default" or "yarn")."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    base_freq = rope.theta**exponents
    if rope.rope_type == "default":
        return 1.0 / base_freq
    if rope.rope_type != "yarn":
        raise ValueError(f"rope_type {rope.rope_type!r} is not supported; use 'default' or 'yarn'")
    if rope.original_max_position_embeddings is None:
        raise ValueError("yarn rope needs original_max_position_embeddings")
    return _yarn_inv_freq(rope, rope_dim, base_freq)


def _yarn_inv_freq(rope: RopeConfig, rope_dim: int, base_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: keep high-frequency pairs (many rotations within the original context), interpolate
    low-frequency ones by ``factor``, blend linearly in between (bounds rounded outwards)."""
    original = rope.original_max_position_embeddings

    def pair_index_for(num_rotations: float) -> float:
        # the pair index whose wavelength fits `num_rotations` times into the original context
        return (rope_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = pair_index_for(rope.beta_fast), pair_index_for(rope.beta_slow)
    if getattr(rope, "truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    extrapolated = 1.0 / base_freq
    interpolated = 1.0 / (rope.factor * base_freq)
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
