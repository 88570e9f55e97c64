"""The cache-free, differentiable forward of a ``DeepseekV41ForCausalLM`` over whole sequences.

Same modules, same parameters and the same math as the serving forward (model.py over the block
cache and SWA slots), computed for ``ids [B, T]`` (positions 0..T-1 each) in one pass:

    Engram (history ids p, p-1, .. p-3 of the sequence)       window keys  [t-W+1, t]
    Full     latents of its own input -> rows + index keys       compressed   entries j < (t+1) // r
    Reindex  scores its kv source's keys (inside the pool)       picks        top index_topk of the
    Reuse    attends its index source's picks                                 index scores

so that training and serving cannot drift (tests/engine/v41/test_v41_dense.py compares the
logits with the engine's). For training it also returns the DSpark target features (mean over
the streams entering each ``dspark_target_layer_ids`` layer), every layer's expert choices, and
the indexers' distillation loss: the indexer picks by hard top-k, which passes no gradient, so
each index source is taught to rank entries like its attention does (KL of the index score
softmax to the head-averaged attention over every reachable entry).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.engine.models.deepseek_v41 import dense_ops as D
from deepinfer.engine.models.deepseek_v41.attention import candidate_pool
from deepinfer.kernels import torch_ref as ref


@dataclass
class DenseOutput:
    hidden: torch.Tensor  # [B, T, D] final hidden state (after the final norm)
    features: torch.Tensor | None = None  # [B, T, targets * D] DSpark target features
    expert_ids: list[torch.Tensor] = field(default_factory=list)  # per backbone layer [B * T, k]
    index_kl: torch.Tensor | None = None  # mean indexer distillation loss (training)


@dataclass
class _Shared:
    """What kv and index sources hand to later layers in one forward."""

    rows: dict = field(default_factory=dict)  # kv source -> rotated compressed rows [B, E, hd]
    keys: dict = field(default_factory=dict)  # kv source -> index keys [B, E, Di]
    picks: dict = field(default_factory=dict)  # index source -> attended entries [B, T, E] bool
    pool: torch.Tensor | None = None  # candidate pool [B, T, E] bool
    kl: list = field(default_factory=list)


def engram_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """Table rows ``[B * T, engram layers, columns]``: hashed n-grams of each sequence (no history
    before position 0: the pad id, as serving does at a sequence start)."""
    n = model.config.engram_max_ngram_size
    cids = model.engram_hash.token_map.index_select(0, ids.reshape(-1)).view(ids.shape)
    shifted = [cids] + [torch.cat([cids.new_full((ids.shape[0], s), -1), cids[:, :-s]], dim=1) for s in range(1, n)]
    return model.engram_hash.rows(torch.stack(shifted, dim=-1).reshape(-1, n))


def dense_forward(model, ids: torch.Tensor, *, features: bool = False, index_kl: bool = False) -> DenseOutput:
    """``ids [B, T]`` -> DenseOutput; differentiable in every parameter of the backbone."""
    c = model.config
    b, t = ids.shape
    eps, n = c.rms_norm_eps, c.hc_mult
    positions = torch.arange(t, device=ids.device)
    tables = {"main": D.rope_tables(positions, model.main_inv_freq),
              "compress": D.rope_tables(positions, model.compress_inv_freq)}
    tables = {k: (cos[None], sin[None]) for k, (cos, sin) in tables.items()}
    streams = D.embed(model.embed_tokens.weight, ids, n)
    pre = torch.zeros(b, t, n, device=ids.device)
    pre[..., 0] = 1.0  # layer 0's attention reads stream 0: the embedding
    rows = engram_rows(model, ids) if c.engram_layer_ids else None
    shared, out = _Shared(), DenseOutput(hidden=streams)
    targets = []
    window = _window_mask(t, c.sliding_window, ids.device)
    for layer in model.layers:
        if layer.engram is not None:
            streams = D.engram(layer.engram, streams.reshape(-1, n, c.hidden_size),
                               rows[:, layer.engram.index]).view(streams.shape)
        if features and layer.self_attn.layer in c.dspark_target_layer_ids:
            targets.append(streams.float().mean(dim=-2))
        attn = layer.self_attn

        def attention(x, attn=attn):
            return _attention(model, attn, x, tables, window, shared, index_kl)

        streams, pre, expert_ids = D.run_block(layer, streams, pre, attention, eps)
        out.expert_ids.append(expert_ids)
    hidden = D.collapse(streams, pre)
    out.hidden = ref.rms_norm(hidden, model.norm.weight, eps)
    if features:
        out.features = torch.cat(targets, dim=-1)
    if index_kl and shared.kl:
        out.index_kl = torch.stack(shared.kl).mean()
    return out


def logits(model, hidden: torch.Tensor) -> torch.Tensor:
    return (hidden @ model.lm_head.weight.t()).float()


def _window_mask(t: int, window: int, device) -> torch.Tensor:
    """``[1, T, T]`` bool: query t sees keys [t - window + 1, t]."""
    q = torch.arange(t, device=device)[:, None]
    k = torch.arange(t, device=device)[None, :]
    return ((k <= q) & (k > q - window))[None]


def _attention(model, attn, x: torch.Tensor, tables, window: torch.Tensor, shared: _Shared,
               want_kl: bool) -> torch.Tensor:
    role = attn.role
    cos, sin = tables[attn.rope_name]
    q, kv, qr = D.attention_inputs(attn, x, cos, sin)
    scale = attn.head_dim**-0.5
    if not role.ratio:
        out = D.sink_attention(q, kv, window, attn.sinks, scale)
        return D.attention_output(attn, out, cos, sin)
    b, t = x.shape[:2]
    r = role.ratio
    if role.is_kv_source:
        latent = D.compressed_latent(attn, x, r)
        first = torch.arange(latent.shape[1], device=x.device) * r  # an entry rotates at its first token
        e_cos, e_sin = (u[None] for u in D.rope_tables(first, model.compress_inv_freq))
        shared.rows[attn.layer] = D.rope(latent, e_cos, e_sin)
        shared.keys[attn.layer] = D.index_keys(attn.indexer, latent, e_cos, e_sin)
    rows = shared.rows[role.kv_source]
    e = rows.shape[1]
    reach = (torch.arange(e, device=x.device)[None, :] < (torch.arange(t, device=x.device)[:, None] + 1) // r)[None]
    if role.is_index_source:
        with torch.set_grad_enabled(want_kl and torch.is_grad_enabled()):  # top-k passes no gradient
            total = D.index_scores(attn.indexer, qr, x, shared.keys[role.kv_source], cos, sin)
        total = total.masked_fill(~reach, D.NEG_INF)
        if want_kl:
            shared.kl.append(_index_kl(q, rows, total, reach, scale))
        total = total.detach()
        chosen = torch.zeros(b, t, e, dtype=torch.bool, device=x.device)
        if e:
            if role.uses_candidates:
                total = total.masked_fill(~shared.pool, D.NEG_INF)
            if role.is_candidate_source:
                valid = reach.expand(b, -1, -1).reshape(b * t, e)
                shared.pool = candidate_pool(total.reshape(b * t, e), valid, attn.candidate_topk_blocks,
                                             attn.candidate_block_size).view(b, t, e)
            chosen.scatter_(-1, total.topk(min(attn.indexer.top_k, e), dim=-1).indices, True)
        elif role.is_candidate_source:
            shared.pool = chosen
        shared.picks[attn.layer] = chosen & reach  # a pick never closed before the token is masked
    keys = torch.cat([kv, rows], dim=1)
    allowed = torch.cat([window.expand(b, -1, -1), shared.picks[role.index_source]], dim=-1)
    out = D.sink_attention(q, keys, allowed, attn.sinks, scale)
    return D.attention_output(attn, out, cos, sin)


def _index_kl(q: torch.Tensor, rows: torch.Tensor, total: torch.Tensor, reach: torch.Tensor,
              scale: float) -> torch.Tensor:
    """KL(attention over every reachable entry, head-averaged, fixed || softmax of index scores),
    averaged over the queries that reach at least one entry."""
    with torch.no_grad():
        scores = torch.einsum("bthd,bed->bthe", q, rows).float() * scale
        target = torch.softmax(scores.masked_fill(~reach.unsqueeze(2), D.NEG_INF), dim=-1).mean(dim=2)
    has = reach.any(-1, keepdim=True).expand(total.shape[0], -1, 1)  # [B, T, 1]: rows that reach an entry
    logp = torch.log_softmax(torch.where(has, total, torch.zeros_like(total)), dim=-1)  # finite rows only
    target = torch.where(has & reach, target, torch.zeros_like(target))
    terms = torch.where(target > 0, target * (torch.log(target.clamp_min(1e-30)) - logp), torch.zeros_like(logp))
    return terms.sum(-1)[has[..., 0]].mean() if bool(has.any()) else terms.sum() * 0
