"""FP8 weights for serving: block-scaled E4M3 matrices and the numbers of a GEMM over them.

    Fp8Weight   data  float8_e4m3fn [*lead, N, K]
                scale float32       [*lead, ceil(N / 128), ceil(K / 128)]
                value[..., n, k] = data[..., n, k] * scale[..., n // 128, k // 128]

This is the layout of DeepSeek's FP8 checkpoints (128 x 128 weight blocks, the stored scale
multiplies). A GEMM over such a weight quantises its input the way DeepSeek's Hopper kernels do
(dynamic, per row and per 128 input columns) and multiplies FP8 by FP8 on the tensor cores:

    quantize_rows(x [..., K]) -> q float8_e4m3fn [..., K], s float32 [..., ceil(K / 128)]
        for each row and each group g of columns [128 g, 128 g + 128) (the last one shorter):
        a = max |x| over the group (float32); s = a / 448 and r = 448 / a (both 1 where a = 0);
        q = clamp(x * r, -448, 448) rounded to the nearest E4M3 (ties to even)
        (one division per group and a product per value: what a GEMM's load can afford)

    linear(x [M, K], w [N, K]) = sum over groups g of (q[:, g] . data[:, g]^T) * s[:, g] * scale[n // 128, g]
        accumulated in float32, rounded once to x's dtype

``linear_ref`` / ``grouped_linear_ref`` compute exactly that with dequantised operands in
float32; they are what torch_ref's ``linear`` / ``grouped_linear`` run for an ``Fp8Weight``
and the oracle of the Triton kernels (kernels/gpu_fp8.py, kernels/gpu_moe.py). A weight that is
not block-aligned (N or K not a multiple of 128) has partial blocks at its edges; nothing is
padded in memory.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # weight blocks are BLOCK x BLOCK; inputs are quantised in groups of BLOCK columns
FP8 = torch.float8_e4m3fn
SCALE_FORMATS = ("float", "ue8m0")


class Fp8FormatError(ValueError):
    """An FP8 weight whose data and scale do not fit together."""


def num_blocks(size: int) -> int:
    return -(-size // BLOCK)


class Fp8Weight:
    """A block-scaled FP8 matrix (or a stack of them along leading dims): what ``ops.linear``,
    ``ops.grouped_linear`` and ``ops.moe_experts_`` take in place of a dense weight."""

    __slots__ = ("data", "scale")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor):
        if data.dtype != FP8:
            raise Fp8FormatError(f"FP8 weight data must be float8_e4m3fn, got {data.dtype}")
        if data.dim() < 2:
            raise Fp8FormatError(f"FP8 weight data must be at least 2-D, got shape {tuple(data.shape)}")
        *lead, n, k = data.shape
        expected = (*lead, num_blocks(n), num_blocks(k))
        if tuple(scale.shape) != expected:
            raise Fp8FormatError(f"FP8 scale shape {tuple(scale.shape)} does not tile weight {tuple(data.shape)} in "
                                 f"{BLOCK}x{BLOCK} blocks (expected {expected})")
        if scale.device != data.device:
            raise Fp8FormatError(f"FP8 scale on {scale.device}, data on {data.device}")
        self.data = data.contiguous()
        self.scale = scale.to(torch.float32).contiguous()

    # the tensor-like surface model code reads
    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, index) -> Fp8Weight:
        """One matrix of a stack (an int or a slice along the first, leading dim)."""
        if self.data.dim() < 3:
            raise IndexError("an FP8 matrix is indexed by its leading (stack) dims only")
        return Fp8Weight(self.data[index], self.scale[index])

    def to(self, device) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scale.to(device))

    def __repr__(self) -> str:
        return f"Fp8Weight(shape={tuple(self.data.shape)}, device={self.data.device})"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``data * scale`` (computed in float32, returned in ``dtype``)."""
        *_, n, k = self.data.shape
        s = self.scale.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]
        return (self.data.to(torch.float32) * s).to(dtype)

    @classmethod
    def quantize(cls, weight: torch.Tensor, scale_format: str = "float") -> Fp8Weight:
        """Per 128 x 128 block: scale = amax / 448 ("float") or the smallest power of two with
        amax / scale <= 448 ("ue8m0", as DeepSeek's checkpoints store it); an all-zero block gets
        scale 1. ``weight [*lead, N, K]`` of any float dtype, on any device."""
        if scale_format not in SCALE_FORMATS:
            raise Fp8FormatError(f"FP8 scale_format must be one of {', '.join(SCALE_FORMATS)}, got {scale_format!r}")
        if weight.dim() < 2 or not weight.is_floating_point():
            raise Fp8FormatError(f"FP8 quantisation needs a float matrix, got {weight.dtype} {tuple(weight.shape)}")
        *lead, n, k = weight.shape
        nb, kb = num_blocks(n), num_blocks(k)
        padded = weight.new_zeros((*lead, nb * BLOCK, kb * BLOCK), dtype=torch.float32)
        padded[..., :n, :k] = weight.to(torch.float32)
        tiles = padded.view(*lead, nb, BLOCK, kb, BLOCK)
        amax = tiles.abs().amax(dim=(-3, -1))
        ratio = amax / torch.full_like(amax, FP8_MAX)  # IEEE on every device (quantize_rows says why)
        if scale_format == "float":
            scale = torch.where(amax > 0, ratio, torch.ones_like(amax))
        else:
            scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(ratio))), torch.ones_like(amax))
        q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
        data = q.view(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].to(FP8)
        return cls(data, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> (q float8_e4m3fn [..., K], s float32 [..., ceil(K / 128)]), the module
    docstring's input quantisation."""
    *lead, k = x.shape
    groups = num_blocks(k)
    padded = x.new_zeros((*lead, groups * BLOCK), dtype=torch.float32)
    padded[..., :k] = x.to(torch.float32)
    g = padded.view(*lead, groups, BLOCK)
    amax = g.abs().amax(dim=-1)
    positive = amax > 0
    # tensors over tensors: IEEE division on every device (CUDA divides a tensor by a Python number
    # as a product with its reciprocal, 1 ulp off amax / 448 for some amax; seen on an H100)
    limit = torch.full_like(amax, FP8_MAX)
    s = torch.where(positive, amax / limit, torch.ones_like(amax))
    r = torch.where(positive, limit / torch.where(positive, amax, 1.0), torch.ones_like(amax))
    q = (g * r.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(*lead, groups * BLOCK)[..., :k]
    return q.contiguous(), s


def dequantize_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float32 ``q * s`` of ``quantize_rows``' output."""
    k = q.shape[-1]
    return q.to(torch.float32) * s.repeat_interleave(BLOCK, dim=-1)[..., :k]


def linear_ref(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """``x [M, K] @ value(weight)[N, K]^T`` with ``x`` quantised per row and 128-column group
    (module docstring), float32 math, result in ``x.dtype``."""
    _check(x, weight, 2)
    if x.shape[-1] != weight.shape[-1]:
        raise Fp8FormatError(f"linear: input has {x.shape[-1]} columns, the FP8 weight {tuple(weight.shape)}")
    xa = dequantize_rows(*quantize_rows(x))
    return (xa @ weight.dequantize(torch.float32).t()).to(x.dtype)


def grouped_linear_ref(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """Block-diagonal: ``x [M, G, K]``, ``weight [G, N, K]`` -> ``[M, G, N]`` (each group's
    input quantised as ``linear_ref`` quantises its input)."""
    _check(x, weight, 3)
    if x.shape[1:] != (weight.shape[0], weight.shape[2]):
        raise Fp8FormatError(f"grouped_linear: input {tuple(x.shape)} does not fit the FP8 weight {tuple(weight.shape)}")
    xa = dequantize_rows(*quantize_rows(x))  # [M, G, K]
    y = torch.bmm(xa.transpose(0, 1), weight.dequantize(torch.float32).transpose(1, 2))  # [G, M, N]
    return y.transpose(0, 1).to(x.dtype)


def _check(x: torch.Tensor, weight: Fp8Weight, weight_dims: int) -> None:
    if not isinstance(weight, Fp8Weight) or weight.dim() != weight_dims:
        raise Fp8FormatError(f"expected a {weight_dims}-D Fp8Weight, got {weight!r}")
    if x.device != weight.device:
        raise Fp8FormatError(f"input on {x.device}, FP8 weight on {weight.device}")
