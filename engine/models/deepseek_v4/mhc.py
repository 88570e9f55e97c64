"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams per token.

Each block reads one collapsed stream (weights ``pre``) and writes ``post_k * out`` plus a
Sinkhorn-normalised mix ``comb`` of the old streams back into every stream; ``hc_head``
collapses the streams once more before the final norm. ``weights`` + ``collapse`` give the same
numbers as separate steps, for V4.1's single pass (collapse with the previous sublayer's pre).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels import ops


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float, device=None):
        super().__init__()
        n = hc_mult
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        f32 = dict(device=device, dtype=torch.float32)
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size, **f32), requires_grad=False)
        self.base = nn.Parameter(torch.empty((2 + n) * n, **f32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, **f32), requires_grad=False)

    def finalize(self) -> None:
        """Per-column scale/bias vectors from ``base``/``scale`` (call once weights are in place)."""
        n = self.hc_mult
        self.pre_post_scale = torch.cat([self.scale[0:1].expand(n), self.scale[1:2].expand(n)])
        self.pre_post_base = self.base[: 2 * n].clone()
        self.comb_scale = float(self.scale[2])  # a Python float: no device read per call
        self.comb_base = self.base[2 * n :].view(n, n).clone()
        self.fn_pre = self.fn[:n].contiguous()  # the pre rows alone (weights())

    def pre(self, streams: torch.Tensor, batch_invariant: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, N, D]`` -> (post [T, N], comb [T, N, N], block input [T, D])."""
        return ops.hc_pre(
            streams, self.fn, self.pre_post_scale, self.pre_post_base, self.comb_scale, self.comb_base,
            norm_eps=self.norm_eps, hc_eps=self.hc_eps, sinkhorn_iters=self.sinkhorn_iters,
            batch_invariant=batch_invariant,
        )  # fmt: skip

    @staticmethod
    def post(block_out, streams, post, comb, batch_invariant: bool) -> torch.Tensor:
        return ops.hc_post(block_out, streams, post, comb, batch_invariant)

    def weights(self, streams: torch.Tensor, batch_invariant: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, N, D]`` -> (pre [T, N], post [T, N], comb [T, N, N]), the numbers of ``pre``
        without the collapse: V4.1's single-pass mHC collapses a sublayer's streams with the pre
        weights of the sublayer before it, so the weights and the collapse are separate steps.
        post/comb come from ``pre`` (one native call on CPU), pre from its own rows of ``fn``."""
        t, n, d = streams.shape
        post, comb, _ = self.pre(streams, batch_invariant)
        flat = ops.rms_norm(streams.reshape(t, n * d).float(), None, self.norm_eps)  # explicit width: t may be 0
        mixes = ops.linear(flat, self.fn_pre, batch_invariant)
        pre = ops.sigmoid(mixes * self.pre_post_scale[:n] + self.pre_post_base[:n], batch_invariant) + self.hc_eps
        return pre, post, comb

    @staticmethod
    def collapse(streams: torch.Tensor, pre: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        """``sum_k pre[:, k] * streams[:, k]`` -> ``[T, D]`` (float32 sum, cast back)."""
        t, n, d = streams.shape
        if streams.dtype != torch.float32:
            return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
        return ops.bmm(pre.unsqueeze(1), streams, batch_invariant).view(t, d)


class HyperHead(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, *, hc_eps: float, norm_eps: float, device=None):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        f32 = dict(device=device, dtype=torch.float32)
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, **f32), requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(hc_mult, **f32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1, **f32), requires_grad=False)

    def forward(self, streams: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        return ops.hc_head(
            streams, self.hc_fn, self.hc_base, self.hc_scale,
            norm_eps=self.norm_eps, hc_eps=self.hc_eps, batch_invariant=batch_invariant,
        )  # fmt: skip
