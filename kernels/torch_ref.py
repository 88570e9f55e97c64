"""Torch reference ops: run on any device, define the numbers every other backend must match.

Batch invariance (``batch_invariant=True``): a row's result must not depend on which other rows
share the call. Measured on CPU (MKL sgemm, AVX2, 1 and 2 threads): ``mm`` takes other kernels
for M in 1-3 (gemv among them) and, multi-threaded, for M in 5-7 and 9-11, but gives identical
per-row results at any row offset for M = 4, M = 8 and every M >= 12; ``bmm`` gives identical
per-entry results for any batch count except a batch of 1 (it falls back to ``mm``). So the
invariant paths round the row count up with ``gemm_rows`` (never more than 3 extra rows) and
the batch count to at least 2. Reductions along the last dimension (sum, mean, softmax, amax)
are per-row already.

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

from deepinfer.kernels import fp8
from deepinfer.kernels.compress_ref import compress_pooled

def gemm_rows(m: int) -> int:
    """Rows to run a GEMM of ``m`` rows with so it takes the kernel every large M takes."""
    return m if m >= 12 else -(-m // 4) * 4


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad], dim=0)


INVARIANT_ROWS = 16  # rows of every GEMM call of a batch-invariant ``linear``


def linear(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T``; with ``batch_invariant`` every row is computed in a GEMM of
    exactly ``INVARIANT_ROWS`` rows (padded), so its sums do not depend on M: the BLAS picks its
    kernel by the row count, and where it switches depends on the machine (on an AVX-512 host
    M = 1 .. 128 each took another kernel at K = 1024, against M < 12 only on AVX2)."""
    if isinstance(weight, fp8.Fp8Weight):  # kernels/fp8.py's numbers, through the dense path below
        rows = fp8.dequantize_rows(*fp8.quantize_rows(x))
        return linear(rows, weight.dequantize(torch.float32), batch_invariant).to(x.dtype)
    m = x.shape[0]
    if batch_invariant and m:
        # one memory layout on every path: a strided input takes another GEMM variant
        x = x.contiguous()
        rows = -(-m // INVARIANT_ROWS) * INVARIANT_ROWS
        if rows != m:
            x = _pad_rows(x, rows)
        if rows == INVARIANT_ROWS:
            return F.linear(x, weight)[:m]
        return torch.cat([F.linear(part, weight) for part in x.split(INVARIANT_ROWS)])[:m]
    return F.linear(x, weight)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """Block-diagonal linear: ``x [M, G, K]``, ``weight [G, N, K]`` -> ``[M, G, N]``."""
    if isinstance(weight, fp8.Fp8Weight):
        rows = fp8.dequantize_rows(*fp8.quantize_rows(x))
        return grouped_linear(rows, weight.dequantize(torch.float32), batch_invariant).to(x.dtype)
    m = x.shape[0]
    if batch_invariant:
        x = x.contiguous()
        if gemm_rows(m) != m:
            x = _pad_rows(x, gemm_rows(m))
    y = torch.bmm(x.transpose(0, 1), weight.transpose(1, 2))  # [G, M, N]
    return y.transpose(0, 1)[:m]


def bmm(a: torch.Tensor, b: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """``a [B, M, K] @ b [B, K, N]``; a batch of one is padded so it takes the batched kernel."""
    if batch_invariant and a.shape[0] == 1:
        return torch.bmm(_twice(a), _twice(b))[:1]
    return torch.bmm(a, b)


def _twice(x: torch.Tensor) -> torch.Tensor:
    """``x [1, ...]`` repeated to a batch of 2 with the same layout of the other dims (a
    transposed operand stays transposed, so it takes the same kernel as any larger batch)."""
    rest = sorted(range(1, x.dim()), key=lambda d: -x.stride(d))
    perm = [0, *rest]
    y = x.permute(perm).contiguous()
    y = torch.cat([y, y])
    return y.permute([perm.index(d) for d in range(x.dim())])


def sigmoid(x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    return torch.sigmoid(x.double()).to(x.dtype) if batch_invariant else torch.sigmoid(x)


def silu(x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    return F.silu(x.double()).to(x.dtype) if batch_invariant else F.silu(x)


def softplus(x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    return F.softplus(x.double()).to(x.dtype) if batch_invariant else F.softplus(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32 (float32 weight), cast back to ``x``'s dtype.

    ``F.rms_norm`` computes ``x * rsqrt(mean(x^2) + eps) * w`` with the reference's rounding
    (checked bitwise in tests/kernels) in one call; ``weight=None`` is the unweighted form.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width tables ``[..., rope_dim]`` for ``apply_rope_``: cos per channel, and sin with
    the pair sign folded in (-sin on even, +sin on odd channels). Negate sin to un-rotate.

    The angle is a float32 product as in the reference; cos/sin are taken in float64 so every
    position gets the same value whatever else is in the call (module note)."""
    freqs = (positions[..., None].float() * inv_freq.float()).double()
    cos = freqs.cos().float().repeat_interleave(2, dim=-1)
    sin = freqs.sin().float().repeat_interleave(2, dim=-1)
    sin[..., 0::2] *= -1
    return cos, sin


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE, in place, on the trailing ``rope_dim`` channels of ``x [R, ..., D]``.

    Pair (2i, 2i+1) becomes ``(x0 c - x1 s, x1 c + x0 s)``: ``x * cos + swap_pairs(x) * sin``
    with the tables of ``rope_tables`` (``[R, rope_dim]``, broadcast over middle dims); float32
    math, same rounding as the reference's rotate-half form. Returns ``x``.
    """
    rope_dim = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    part = x[..., -rope_dim:]
    xf = part if part.dtype == torch.float32 else part.float()
    swapped = xf.unflatten(-1, (rope_dim // 2, 2)).flip(-1).flatten(-2)
    part.copy_(xf * cos.view(shape) + swapped * sin.view(shape))
    return x


def attention_with_sink(
    q: torch.Tensor,
    keys: torch.Tensor,
    bias: torch.Tensor,
    sinks: torch.Tensor,
    sink_slot: int,
    scale: float,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Shared-KV multi-query attention of each token over its own key set, with a sink logit.

    ``q [G, H, D]``; ``keys [G, N, D]`` (K = V) where row ``sink_slot`` is an all-zero row
    standing for the sink; ``bias [G, 1, N]`` additive (0 / -inf; 0 at the sink slot);
    ``sinks [H]`` the per-head sink logit, written over the sink slot's logit: the sink sits in
    the softmax denominator and, its row being zero, adds nothing to the output. Each token's
    key set has a fixed size chosen by the caller, so its numbers never depend on the other
    tokens in ``q``.
    """
    scores = bmm(q, keys.transpose(1, 2), batch_invariant)
    # logits and softmax in float32 whatever the compute dtype (the sink is a float32 parameter)
    logits = (scores if scores.dtype == torch.float32 else scores.float()) * scale + bias
    logits[:, :, sink_slot] = sinks
    probs = torch.softmax(logits, dim=-1)
    return bmm(probs if probs.dtype == keys.dtype else probs.to(keys.dtype), keys, batch_invariant)


def gathered_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    pool_rows: torch.Tensor,
    pool_bias: torch.Tensor,
    extra: torch.Tensor | None,
    extra_rows: torch.Tensor | None,
    extra_bias: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``attention_with_sink`` over key sets gathered by row ids: token g attends rows
    ``pool[pool_rows[g]]`` (``[G, L + 1]``, the last one the pool's zero row standing for the
    sink) and then, if given, ``extra[extra_rows[g]]`` (``[G, K]``); biases ``[G, 1, L + 1]`` and
    ``[G, 1, K]`` (0 / -inf). Backends may skip materialising the key sets."""
    num, width = pool_rows.shape
    keys = pool.index_select(0, pool_rows.reshape(-1)).view(num, width, pool.shape[-1])  # explicit: may be empty
    bias = pool_bias
    if extra is not None:
        more = extra.index_select(0, extra_rows.reshape(-1)).view(num, extra_rows.shape[1], extra.shape[-1])
        keys = torch.cat([keys, more], dim=1)
        bias = torch.cat([bias, extra_bias], dim=-1)
    return attention_with_sink(q, keys, bias, sinks, width - 1, scale, batch_invariant)


def index_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    cand_valid: torch.Tensor,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """CSA lightning-indexer scores ``sum_h w_h * relu(q_h . k) / sqrt(Di)`` ``[G, B]`` float32,
    -inf where ``cand_valid`` is False: ``q [G, H, Di]`` (keys' dtype), ``head_weights [G, H]``
    float32, ``keys [G, B, Di]`` (each token's own candidates), ``cand_valid [G, B]`` bool. The
    products are rounded to the keys' dtype, the rest is float32."""
    scores = bmm(q, keys.transpose(1, 2), batch_invariant).float()  # [G, H, B]
    scores = torch.relu(scores) * q.shape[-1] ** -0.5
    total = (scores * head_weights[:, :, None]).sum(dim=1)  # [G, B]
    return total.masked_fill(~cand_valid, float("-inf"))


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
    pre_post_scale: torch.Tensor,
    pre_post_base: torch.Tensor,
    comb_scale: torch.Tensor | float,
    comb_base: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC weights for one block: ``streams [T, N, D]`` -> (post [T, N], comb [T, N, N], collapsed [T, D]).

    pre/post are sigmoids of a linear map of the RMS-normalised flattened streams
    (``pre_post_scale/base [2N]`` hold the per-column scale and bias of both); comb is a softmax
    projected towards a doubly-stochastic matrix by Sinkhorn-Knopp (column first).
    """
    t, n, d = streams.shape
    flat = rms_norm(streams.reshape(t, n * d).float(), None, norm_eps)  # explicit width: t may be 0
    mixes = linear(flat, fn, batch_invariant)
    pre_post = sigmoid(mixes[:, : 2 * n] * pre_post_scale + pre_post_base, batch_invariant)
    pre = pre_post[:, :n] + hc_eps
    post = pre_post[:, n:] * 2
    comb = torch.softmax(mixes[:, 2 * n :].view(t, n, n) * comb_scale + comb_base, dim=-1) + hc_eps
    comb = sinkhorn(comb, sinkhorn_iters, hc_eps)
    if streams.dtype != torch.float32:
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    else:
        collapsed = bmm(pre.unsqueeze(1), streams, batch_invariant).view(t, d)
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
    if dtype != torch.float32:
        post, comb = post.to(dtype), comb.to(dtype)
    mixed = bmm(comb.transpose(1, 2), streams, batch_invariant)
    return post.unsqueeze(-1) * block_out.unsqueeze(1) + mixed


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
    t, n, d = streams.shape
    flat = rms_norm(streams.reshape(t, n * d).float(), None, norm_eps)  # explicit width: t may be 0
    mixes = linear(flat, fn.float(), batch_invariant)
    pre = sigmoid(mixes * scale.float() + base.float(), batch_invariant) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def moe_route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
    top_k: int,
    scoring_func: str,
    routed_scaling_factor: float,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (expert ids ``[T, k]`` ascending, float32 weights ``[T, k]``).

    Scores are ``sqrtsoftplus``/``sigmoid``/``softmax`` of the logits; experts come from
    ``hash_ids`` (hash layers) or the top-k of score + correction bias (the bias only steers
    the choice); weights are the chosen scores normalised to sum 1, times the scaling factor.
    """
    if scoring_func == "sqrtsoftplus":
        scores = softplus(logits, batch_invariant).sqrt()
    elif scoring_func == "sigmoid":
        scores = sigmoid(logits, batch_invariant)
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"scoring_func {scoring_func!r} is not supported; use one of {SCORING_FUNCS}")
    if hash_ids is not None:
        ids = hash_ids
    else:
        ids = torch.topk(scores + correction_bias, top_k, dim=-1, sorted=False).indices
    ids = ids.sort(dim=-1).values
    weights = scores.gather(1, ids).float()
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * routed_scaling_factor


def moe_combine_(out: torch.Tensor, rows: torch.Tensor, row_of_pair: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] += sum_j weights[t, j] * rows[row_of_pair[t * k + j]]`` for the first T rows, j in order."""
    t, k = weights.shape
    per_pair = rows.index_select(0, row_of_pair).view(t, k, rows.shape[-1])  # explicit width: t may be 0
    out[:t] += (per_pair * weights.to(rows.dtype).unsqueeze(-1)).sum(dim=1)
    return out


def swiglu_clamped(gate_up: torch.Tensor, limit: float, batch_invariant: bool = False) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` for ``gate_up = [gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return silu(gate.clamp(max=limit), batch_invariant) * up.clamp(min=-limit, max=limit)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope_(rms_norm(x, weight, eps), cos, sin)``: a query's or key's norm and rotation."""
    return apply_rope_(rms_norm(x, weight, eps), cos, sin)


def compress_pool(kv, gate, ring_kv, ring_gate, ring_rows, src_index, src_valid, position_bias, ratio: int,
                  head_dim: int, overlap: bool, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A gated compressor's entries ``[E, head_dim]`` before the rotation: ``rms_norm`` of
    ``compress_pooled`` (kernels/compress_ref.py: shapes, slot layout and rounding)."""
    pooled = compress_pooled(kv, gate, ring_kv, ring_gate, ring_rows, src_index, src_valid, position_bias, ratio,
                             head_dim, overlap)
    return rms_norm(pooled, norm_weight, eps)


def moe_experts_(out: torch.Tensor, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, limit: float, batch_invariant: bool = False) -> torch.Tensor:
    """Routed experts added onto ``out``: ``out[t] += sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``
    for the first T rows (T = ``len(expert_ids)``), expert e being ``down[e] @ swiglu_clamped(gate_up[e]
    @ x)``; slot order j in the sum. The oracle of fused backends: one expert at a time (host sync)."""
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    rows = x.new_zeros(t * k, x.shape[-1])
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero()[:, 0]
        hidden = linear(x.index_select(0, pairs // k), gate_up[e], batch_invariant)
        rows[pairs] = linear(swiglu_clamped(hidden, limit, batch_invariant), down[e], batch_invariant)
    return moe_combine_(out, rows, torch.arange(t * k, device=x.device), weights)
