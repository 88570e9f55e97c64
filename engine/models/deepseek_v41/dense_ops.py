"""Autograd building blocks of V4.1's cache-free forward, computed on the serving modules' weights.

Each function takes a module of the serving model (a ``V41Block``'s HyperConnection, attention,
MoE, Engram) and computes what that module computes over the serving caches, for whole
sequences at once and with differentiable torch ops only: the numbers of kernels/torch_ref.py
(no native kernels, no in-place writes, no caches). The model's cache-free forward
(dense_forward.py) and the DSpark drafter (dspark.py) are built from these, so training, the
drafter and serving read the same parameters; tests/engine/v41/test_v41_dense.py checks the
logits against the serving engine's.

Shapes: ``[N, ...]`` are flat token rows; attention works on ``[B, T, ...]`` (B sequences or
draft blocks of T positions). mHC, routing and softmaxes run in float32 as in serving.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer.kernels import torch_ref as ref

NEG_INF = float("-inf")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``rope_dim`` channels of ``x`` (out of place).

    Tables come from ``torch_ref.rope_tables`` (negate ``sin`` to un-rotate) and have ``x``'s
    leading dims (or 1s that broadcast): ``x [B, T, (H,) D]`` takes ``cos [B|1, T, rope_dim]``."""
    rd = cos.shape[-1]
    shape = cos.shape[:-1] + (1,) * (x.dim() - cos.dim()) + (rd,)
    part = x[..., -rd:].float()
    swapped = part.unflatten(-1, (rd // 2, 2)).flip(-1).flatten(-2)
    rotated = (part * cos.view(shape) + swapped * sin.view(shape)).to(x.dtype)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.rope_tables(positions, inv_freq.to(positions.device))


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns first, then ``iters - 1`` row/column rounds (torch_ref.sinkhorn, out of place)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mhc_weights(hc, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``HyperConnection.weights``: ``streams [N, n, D]`` -> (pre [N, n], post [N, n], comb [N, n, n])."""
    n = hc.hc_mult
    flat = ref.rms_norm(streams.flatten(1).float(), None, hc.norm_eps)
    mixes = flat @ hc.fn.t()
    pre = torch.sigmoid(mixes[:, :n] * hc.scale[0] + hc.base[:n]) + hc.hc_eps
    post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * hc.scale[1] + hc.base[n : 2 * n])
    comb = torch.softmax(mixes[:, 2 * n :].view(-1, n, n) * hc.scale[2] + hc.base[2 * n :].view(n, n), dim=-1)
    return pre, post, sinkhorn(comb + hc.hc_eps, hc.sinkhorn_iters, hc.hc_eps)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_k pre[..., k] * streams[..., k, :]`` in float32."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``post_k * out + sum_i comb[i, k] * streams_i`` (``[N, n, D]``)."""
    mixed = torch.einsum("nij,nid->njd", comb.to(streams.dtype), streams)
    return post.to(streams.dtype).unsqueeze(-1) * out.unsqueeze(1) + mixed


def run_block(layer, streams: torch.Tensor, pre: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor],
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ``V41Block`` (or DSpark stage) under single-pass mHC (block.py's order).

    ``streams [..., n, D]``, ``pre [..., n]`` the previous sublayer's pre; ``attention`` maps the
    normed attention input ``[..., D]`` to its output. -> (streams, this FFN's pre, expert ids [N, k])."""
    lead, (n, d) = streams.shape[:-2], streams.shape[-2:]
    flat, pre = streams.reshape(-1, n, d), pre.reshape(-1, n)
    attn_pre, post, comb = mhc_weights(layer.attn_hc, flat)
    x = ref.rms_norm(collapse(flat, pre), layer.input_layernorm.weight, eps)
    out = attention(x.view(*lead, d)).reshape(-1, d)
    flat = hc_post(out, flat, post, comb)
    ffn_pre, post, comb = mhc_weights(layer.ffn_hc, flat)
    x = ref.rms_norm(collapse(flat, attn_pre), layer.post_attention_layernorm.weight, eps)
    out, expert_ids = moe(layer.mlp, x)
    flat = hc_post(out, flat, post, comb)
    return flat.view(*lead, n, d), ffn_pre.view(*lead, n), expert_ids


# ---- MoE -------------------------------------------------------------------------------------
def moe(mlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``MoE.forward`` on ``x [N, D]``: routed experts (learned top-k of score + bias) plus the
    shared expert. -> (out [N, D], expert ids [N, k] ascending)."""
    gate, ex, shared = mlp.gate, mlp.experts, mlp.shared_experts
    logits = x @ gate.weight.t()
    ids, weights = ref.moe_route(logits, gate.e_score_correction_bias, None, gate.top_k, gate.scoring_func,
                                 gate.routed_scaling_factor)
    gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
    out = ref.swiglu_clamped(x @ gate_up.t(), shared.limit) @ shared.down_proj.weight.t()
    k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token = order // k  # token of each (token, slot) pair, grouped by expert
    counts = torch.bincount(flat_ids, minlength=ex.num_experts).tolist()
    rows = x.index_select(0, token)
    gate_up_w, down_w = ex.gate_up_proj, ex.down_proj
    parts = []
    for e, part in enumerate(rows.split(counts)):
        if counts[e]:
            parts.append(ref.swiglu_clamped(part @ gate_up_w[e].t(), ex.limit) @ down_w[e].t())
    routed = torch.cat(parts) * weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(-1)
    return out.index_add(0, token, routed), ids


# ---- Engram ----------------------------------------------------------------------------------
def engram(module, streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``Engram.forward`` on every row: ``streams [N, n, D]``, ``rows [N, columns]`` table rows."""
    n, d = module.hc_mult, module.hidden
    kv = module.lookup(rows, streams.dtype) @ module.wkv.weight.t()
    key = kv[:, : n * d].float().view(-1, n, d)
    value = kv[:, n * d :].float()
    x = streams.float()
    rstd = torch.rsqrt(x.square().mean(-1) + module.eps) * torch.rsqrt(key.square().mean(-1) + module.eps)
    dot = (x * (module.q_weight * module.k_weight) * key).sum(-1) * rstd * d**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (x + gate.unsqueeze(-1) * value.unsqueeze(1)).to(streams.dtype)


# ---- attention -------------------------------------------------------------------------------
def attention_inputs(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``x [B, T, D]`` -> (q [B, T, nh, hd], kv [B, T, hd], qr [B, T, q_lora]): rotated queries
    (no per-head norm in V4.1), the shared K=V row, and the normed q_a output the indexer reads."""
    qr = ref.rms_norm(x @ attn.q_a_proj.weight.t(), attn.q_a_norm.weight, attn.eps)
    q = rope((qr @ attn.q_b_proj.weight.t()).unflatten(-1, (attn.num_heads, attn.head_dim)), cos, sin)
    kv = rope(ref.rms_norm(x @ attn.kv_proj.weight.t(), attn.kv_norm.weight, attn.eps), cos, sin)
    return q, kv, qr


def sink_attention(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Shared-KV attention with a per-head sink logit in the denominator: ``q [B, T, H, D]``,
    ``keys [B, S, D]`` (K = V), ``allowed [B|1, T, S]`` bool -> ``[B, T, H, D]``."""
    scores = torch.einsum("bthd,bsd->bhts", q, keys).float() * scale
    scores = scores.masked_fill(~allowed.unsqueeze(1), NEG_INF)
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhts,bsd->bthd", probs.to(keys.dtype), keys)


def attention_output(attn, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Un-rotate ``out [B, T, nh, hd]`` at the query positions, grouped low-rank o_a, then o_b."""
    out = rope(out, cos, -sin)
    g = attn.o_groups
    w_a = attn.o_a_proj.weight.view(g, attn.o_lora_rank, -1)
    mixed = torch.einsum("btgi,gri->btgr", out.flatten(-2).unflatten(-1, (g, -1)), w_a)
    return mixed.flatten(-2) @ attn.o_b_proj.weight.t()


def compressed_latent(attn, x: torch.Tensor, ratio: int) -> torch.Tensor:
    """Pre-RoPE normed latents ``[B, E, hd]`` (E = T // ratio) of a kv source's compressor:
    ratio 1 one row per token; ratio 2 a per-channel gate softmax over each closed pair."""
    comp = attn.compressor
    kv = x @ comp.kv_proj.weight.t()
    b, t, hd = kv.shape
    e = t // ratio
    if comp.gate_proj is None:
        return ref.rms_norm(kv, comp.kv_norm.weight, comp.eps)
    gate = (x @ comp.gate_proj.weight.t()).float()[:, : e * ratio].view(b, e, ratio, hd)
    weights = gate.softmax(dim=2).to(kv.dtype)
    pooled = (kv[:, : e * ratio].view(b, e, ratio, hd) * weights).sum(dim=2)
    return ref.rms_norm(pooled, comp.kv_norm.weight, comp.eps)


def index_keys(indexer, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``Indexer.keys``: ``latent [B, E, hd]`` -> rotated index keys ``[B, E, index_head_dim]``."""
    return rope(ref.rms_norm(latent @ indexer.k_proj.weight.t(), indexer.k_norm.weight, indexer.eps), cos, sin)


def index_scores(indexer, qr: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """``sum_h w_h relu(q_h . k) / sqrt(Di)`` of every query against every key: ``[B, T, E]`` float32
    (reachability is the caller's mask)."""
    q = rope((qr @ indexer.q_b_proj.weight.t()).unflatten(-1, (indexer.num_heads, indexer.head_dim)), cos, sin)
    w = (x @ indexer.weights_proj.weight.t()).float() * indexer.num_heads**-0.5
    scores = torch.relu(torch.einsum("bthd,bed->bthe", q, keys).float()) * indexer.head_dim**-0.5
    return (scores * w.unsqueeze(-1)).sum(dim=2)


def embed(weight: torch.Tensor, ids: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """Token rows expanded to ``hc_mult`` identical streams: ``ids [...]`` -> ``[..., n, D]``."""
    rows = F.embedding(ids, weight)
    return rows.unsqueeze(-2).expand(*rows.shape[:-1], hc_mult, rows.shape[-1])
