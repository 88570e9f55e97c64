"""Small building blocks shared by the V4 modules."""

from __future__ import annotations

import torch
from torch import nn


class Norm(nn.Module):
    """Holds an RMSNorm weight (float32 in every compute dtype); the math is ``ops.rms_norm``."""

    def __init__(self, dim: int, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=torch.float32), requires_grad=False)


def linear_holder(in_features: int, out_features: int, device=None, dtype=None) -> nn.Linear:
    """An ``nn.Linear`` without bias used only as a named weight holder (canonical tensor names)."""
    layer = nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    layer.weight.requires_grad_(False)
    return layer


def fuse_linears(layers: list[nn.Linear]) -> tuple[torch.Tensor, list[int]]:
    """Concatenate the weights of linears that read the same input into one ``[sum N, K]`` matrix
    and re-point each layer's weight at its rows of it (one GEMM instead of several, no copy kept).

    Call after the weights are loaded and moved to their final device/dtype.
    """
    fused = torch.cat([layer.weight.detach() for layer in layers], dim=0)
    sizes = [layer.weight.shape[0] for layer in layers]
    start = 0
    for layer, n in zip(layers, sizes):
        layer.weight = nn.Parameter(fused[start : start + n], requires_grad=False)
        start += n
    return fused, sizes


def release_weights(layers: list[nn.Linear]) -> None:
    """Drop the weights of holders whose matrices now live elsewhere (an FP8 copy): each weight
    becomes an empty tensor, so the dense matrix they pointed into can be freed."""
    for layer in layers:
        w = layer.weight
        layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)
