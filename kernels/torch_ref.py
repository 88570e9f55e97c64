"""Torch reference ops: run on any device, define the numbers every other backend must match.

Batch invariance (``batch_invariant=True``): a row's result must not depend on which other rows
share the call. Measured on CPU (MKL sgemm, AVX2): ``mm`` takes a different kernel when
M == 1 (gemv) and for a few small M (2, 3, 5-7, 9-11), but gives identical per-row results for
every M >= 12 at any row offset; ``bmm`` gives identical per-entry results for any batch count
except a batch of 1 (it then falls back to ``mm``/gemv). So the invariant paths pad the row count
to at least ``MIN_GEMM_ROWS`` and the batch count to at least 2. Reductions along the last
dimension (sum, mean, softmax, amax) are per-row already.

Transcendental elementwise ops (exp, sigmoid, silu, softplus, cos, sin) are the other trap: the
vectorised CPU loop computes the last < 16 elements of a call (and of each thread's chunk) with
a scalar libm path that can differ by one ulp, so a token's value would depend on where its row
lands in the flat tensor. In invariant mode they run in float64 and round to the input dtype,
which hides the one-ulp difference of the double paths. tests/kernels checks all of this.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

MIN_GEMM_ROWS = 16


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad], dim=0)


def linear(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T``; with ``batch_invariant`` every row takes the M >= 16 kernel."""
    m = x.shape[0]
    if batch_invariant:
        # one memory layout on every path: a strided input takes another GEMM variant
        x = x.contiguous()
        if m < MIN_GEMM_ROWS:
            return F.linear(_pad_rows(x, MIN_GEMM_ROWS), weight)[:m]
    return F.linear(x, weight)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """Block-diagonal linear: ``x [M, G, K]``, ``weight [G, N, K]`` -> ``[M, G, N]``."""
    m = x.shape[0]
    if batch_invariant:
        x = x.contiguous()
        if m < MIN_GEMM_ROWS:
            x = _pad_rows(x, MIN_GEMM_ROWS)
    y = torch.bmm(x.transpose(0, 1), weight.transpose(1, 2))  # [G, M, N]
    return y.transpose(0, 1)[:m]


def bmm(a: torch.Tensor, b: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """``a [B, M, K] @ b [B, K, N]``; a batch of one is padded so it takes the batched kernel."""
    if batch_invariant:
        a, b = a.contiguous(), b.contiguous()  # padding must not change the operands' layout
        if a.shape[0] == 1:
            return torch.bmm(torch.cat([a, a]), torch.cat([b, b]))[:1]
    return torch.bmm(a, b)


def sigmoid(x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    return torch.sigmoid(x.double()).to(x.dtype) if batch_invariant else torch.sigmoid(x)


def silu(x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    return F.silu(x.double()).to(x.dtype) if batch_invariant else F.silu(x)


def softplus(x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    return F.softplus(x.double()).to(x.dtype) if batch_invariant else F.softplus(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 with a float32 weight, cast back to ``x``'s dtype once at the end."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[..., rope_dim // 2]`` (float32), one angle per interleaved channel pair.

    The angle is a float32 product; cos/sin are taken in float64 so every position gets the same
    value whatever else is in the call (see the module note on transcendental ops)."""
    freqs = (positions[..., None].float() * inv_freq.float()).double()
    return freqs.cos().float(), freqs.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the *trailing* ``2 * cos.shape[-1]`` channels of ``x [T, ..., D]``.

    ``cos``/``sin`` are ``[T, R/2]`` and broadcast over the middle dims. Pass ``-sin`` for the
    inverse rotation. Channel pairs are (2i, 2i+1) of the rope slice; math in float32.
    """
    half = cos.shape[-1]
    rope_dim = 2 * half
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    pairs = x[..., -rope_dim:].float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rope_dim], rotated], dim=-1)


def attention_with_sink(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    biases: list[torch.Tensor],
    sinks: torch.Tensor,
    scale: float,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Shared-KV multi-query attention of each token over its own key set, with a sink logit.

    ``q [G, H, D]``; ``keys[i] [G, N_i, D]`` (K = V) with additive ``biases[i] [G, 1, N_i]``
    (0 or -inf) - one segment per key source (window rows, compressed entries). ``sinks [H]`` is a
    per-head logit in the softmax denominator with no value. Each token's key set has a fixed size
    chosen by the caller, so its numbers never depend on the other tokens in ``q``.
    """
    # logits and softmax in float32 whatever the compute dtype (the sink is a float32 parameter)
    logits = [bmm(q, k.transpose(1, 2), batch_invariant).float() * scale + b for k, b in zip(keys, biases)]
    g, h = q.shape[0], q.shape[1]
    logits.append(sinks.float().view(1, h, 1).expand(g, h, 1))
    combined = torch.cat(logits, dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1).to(q.dtype)
    out = None
    start = 0
    for k in keys:
        n = k.shape[1]
        part = bmm(probs[..., start : start + n].contiguous(), k, batch_invariant)
        out = part if out is None else out + part
        start += n
    return out


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp on ``[T, N, N]`` (columns first, then ``iters - 1`` row/column rounds).

    On CPU the loop runs in numpy on the same memory: ~120 ops on tiny arrays cost several
    times less there than torch's per-op dispatch, with bitwise the same float32 results
    (elementwise division and short fixed-order sums).
    """
    if comb.device.type == "cpu" and comb.dtype == torch.float32:
        c = comb.numpy()
        e = np.float32(eps)
        c /= c.sum(axis=-2, keepdims=True) + e
        for _ in range(iters - 1):
            c /= c.sum(axis=-1, keepdims=True) + e
            c /= c.sum(axis=-2, keepdims=True) + e
        return comb
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC weights for one block: ``streams [T, N, D]`` -> (post [T, N], comb [T, N, N], collapsed [T, D]).

    pre/post are sigmoids of a linear map of the RMS-normalised flattened streams; comb is a
    softmax projected towards a doubly-stochastic matrix by Sinkhorn-Knopp (column first).
    """
    t, n, _ = streams.shape
    flat = rms_norm_unweighted(streams.reshape(t, -1).float(), norm_eps)
    mixes = linear(flat, fn.float(), batch_invariant)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = sigmoid(pre_w * scale[0] + pre_b, batch_invariant) + hc_eps
    post = 2 * sigmoid(post_w * scale[1] + post_b, batch_invariant)
    comb = torch.softmax(comb_w.view(t, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = sinkhorn(comb, sinkhorn_iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_post(
    block_out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """New streams ``post_k * out + sum_j comb[j, k] * streams_j`` -> ``[T, N, D]``."""
    dtype = streams.dtype
    mixed = bmm(comb.to(dtype).transpose(1, 2), streams, batch_invariant)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(1) + mixed


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Final collapse of the mHC streams ``[T, N, D]`` -> ``[T, D]``."""
    t = streams.shape[0]
    flat = rms_norm_unweighted(streams.reshape(t, -1).float(), norm_eps)
    mixes = linear(flat, fn.float(), batch_invariant)
    pre = sigmoid(mixes * scale.float() + base.float(), batch_invariant) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def swiglu_clamped(gate_up: torch.Tensor, limit: float, batch_invariant: bool = False) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` for ``gate_up = [gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return silu(gate.clamp(max=limit), batch_invariant) * up.clamp(min=-limit, max=limit)
