"""V4.1 attention: V4's shared-KV MQA with sink over a window pool, plus compressed KV shared by layers.

Per layer role (roles.py), for a compressed layer of ratio r reading kv source S:

    Full      compress this layer's input: closed groups -> latent (pre-RoPE, normed) ->
              paged row rope(latent) and index key rope(k_norm(wk(latent))), both in S's blocks;
              then score S's keys like a Reindex layer
    Reindex   index q = rope(wq_b(q_norm(wq_a(h)))), head weights weights_proj(h) / sqrt(H);
              score sum_h w_h relu(q_h . k) / sqrt(D) over S's keys (inside the candidate pool
              when the candidate source is below), keep the top ``index_topk``
    Reuse     attend the picks its index source made in this forward

The candidate source keeps, per query, the best ``candidate_topk_blocks`` blocks of
``candidate_block_size`` compressed positions by their best score (the block holding the newest
reachable position always), and publishes them as a mask. A query sees compressed entries
j < (t + 1) // r. Unlike V4 the query heads are not normalised. Window rows, sink, output
projection and all cache traffic are V4's (deepseek_v4/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.cache.block_cache import BlockCache
from deepinfer.cache.swa_state import SwaArena
from deepinfer.engine.models.deepseek_v4.attention import Attention, _write_ring
from deepinfer.engine.models.deepseek_v4.compressor import Compressor, index_scores, top_entries
from deepinfer.engine.models.deepseek_v4.context import NEG_INF, ForwardContext, TokenGroup
from deepinfer.engine.models.deepseek_v4.layers import Norm, linear_holder
from deepinfer.engine.models.deepseek_v41.numerics import Numerics
from deepinfer.engine.models.deepseek_v41.roles import LayerRole
from deepinfer.kernels import ops


@dataclass(slots=True)
class SharedPicks:
    """What index sources hand to later layers within one forward, per token group."""

    picks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # (layer, group)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)  # group -> [G, B] bool pool mask


class Indexer(nn.Module):
    """Query side on every index source; key side (``k_proj``, ``k_norm``) on kv sources only."""

    def __init__(self, config, owns_keys: bool, device=None, dtype=None):
        super().__init__()
        c = config
        self.num_heads, self.head_dim, self.top_k, self.eps = c.index_n_heads, c.index_head_dim, c.index_topk, c.rms_norm_eps
        self.q_b_proj = linear_holder(c.q_lora_rank, c.index_n_heads * c.index_head_dim, device, dtype)
        self.weights_proj = linear_holder(c.hidden_size, c.index_n_heads, device, dtype)
        self.k_proj = linear_holder(c.head_dim, c.index_head_dim, device, dtype) if owns_keys else None
        self.k_norm = Norm(c.index_head_dim, device) if owns_keys else None

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        """Index keys ``[E, index_head_dim]`` of latents rotated at their group's first position."""
        keys = ops.rms_norm(ops.linear(latent, self.k_proj.weight, batch_invariant), self.k_norm.weight, self.eps)
        return ops.apply_rope_(keys, cos, sin)


def candidate_pool(total: torch.Tensor, valid: torch.Tensor, top_blocks: int, block_size: int) -> torch.Tensor:
    """``[G, B]`` bool: candidates inside the best ``top_blocks`` blocks of ``block_size`` entries.

    A block scores its best entry (unreachable entries are -inf in ``total``); the block holding
    a token's newest reachable entry is always kept (it is still filling); blocks with no
    reachable entry are never kept."""
    g, b = total.shape
    num_blocks = -(-b // block_size)
    scores = F.pad(total, (0, num_blocks * block_size - b), value=NEG_INF).view(g, num_blocks, block_size).amax(-1)
    newest = (valid.sum(dim=-1) - 1).div(block_size, rounding_mode="floor")  # -1 when nothing is reachable
    scores = scores.masked_fill(torch.arange(num_blocks, device=total.device)[None, :] == newest[:, None], float("inf"))
    top = scores.topk(min(top_blocks, num_blocks), dim=-1)
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top.indices, top.values > NEG_INF)
    return keep.repeat_interleave(block_size, dim=-1)[:, :b]


class V41Attention(Attention):
    def __init__(self, config, role: LayerRole, device=None, dtype=None, numerics: Numerics | None = None):
        super().__init__(config, role.layer, device, dtype, q_head_norm=False, with_compressor=False)
        c = config
        self.role = role
        self.numerics = numerics or Numerics()
        self.candidate_topk_blocks, self.candidate_block_size = c.candidate_topk_blocks, c.candidate_block_size
        if role.is_kv_source:
            self.compressor = Compressor(c.hidden_size, c.head_dim, role.ratio, False, c.rms_norm_eps, device, dtype,
                                         position_bias=False, gated=role.ratio > 1)
        if role.is_index_source:
            self._modules["indexer"] = Indexer(c, role.is_kv_source, device, dtype)  # beside the base property

    @property
    def indexer(self) -> Indexer | None:
        return self._modules.get("indexer")

    def input_linears(self) -> list[nn.Linear]:
        inputs = [self.q_a_proj, self.kv_proj]
        if self.compressor is not None:
            inputs += self.compressor.input_linears()
        if self.indexer is not None:
            inputs.append(self.indexer.weights_proj)
        return inputs

    def q_b_linears(self) -> list[nn.Linear]:
        return [self.q_b_proj] + ([self.indexer.q_b_proj] if self.indexer is not None else [])

    def project(self, h: torch.Tensor, ctx: ForwardContext, index_tables: tuple = ()):
        """V4's projections; with the released numerics q_a/kv (FP8 weights) read the input rounded
        to FP8 and the compressor / head-weight projections (BF16 weights) read it as it is."""
        num = self.numerics
        if not num.official:
            return super().project(h, ctx, index_tables)
        bi, rows, nh, hd = ctx.batch_invariant, ctx.num_rows, self.num_heads, self.head_dim
        rope = ctx.rope[self.rope_name]
        n_fp8 = self.in_sizes[0] + self.in_sizes[1]
        parts = [ops.linear(num.act(h), self.w_in[:n_fp8], bi)]
        if self.w_in.shape[0] > n_fp8:
            parts.append(ops.linear(h, self.w_in[n_fp8:], bi))
        proj = torch.cat(parts, dim=-1).split(self.in_sizes, dim=-1)
        q_all = ops.linear(num.act(ops.rms_norm(proj[0], self.q_a_norm.weight, self.eps)), self.w_qb, bi)
        q = ops.apply_rope_(q_all[:, : nh * hd].reshape(rows, nh, hd).contiguous(), rope.cos, rope.sin)
        kv = ops.apply_rope_(ops.rms_norm(proj[1], self.kv_norm.weight, self.eps), rope.cos, rope.sin)
        if index_tables:
            heads, dim, cos, sin = index_tables
            ops.apply_rope_(q_all[:, nh * hd :].view(rows, heads, dim), cos, sin)
        return proj, q_all, q, kv

    def output(self, out: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """V4's output projection; with the released numerics wo_b (FP8) reads its input rounded."""
        if not self.numerics.official:
            return super().output(out, ctx)
        bi, rows, rope = ctx.batch_invariant, ctx.num_rows, ctx.rope[self.rope_name]
        ops.apply_rope_(out, rope.cos, rope.neg_sin)
        mixed = ops.grouped_linear(out.view(rows, self.o_groups, -1), self.w_o_a, bi).reshape(rows, -1)
        return ops.linear(self.numerics.act(mixed), self.o_b_proj.weight, bi)

    def forward(self, h: torch.Tensor, ctx: ForwardContext, blocks: BlockCache, swa: SwaArena,
                shared: SharedPicks) -> torch.Tensor:
        bi, rows, nh, hd = ctx.batch_invariant, ctx.num_rows, self.num_heads, self.head_dim
        ix, num = self.indexer, self.numerics
        index_tables = () if ix is None else (ix.num_heads, ix.head_dim, *ctx.rope["compress"].tables())
        proj, q_all, q, kv = self.project(h, ctx, index_tables)
        num.window_kv_(kv)
        if not self.ratio:
            return self.output(self.attend(q, kv, ctx.window.groups, ctx, swa, _no_compressed), ctx)
        plan = ctx.compress[(self.ratio, False)]
        if self.compressor is not None:
            self._write_entries(proj, plan, blocks, swa, bi)
        index_q = index_w = None
        if ix is not None:
            index_w = proj[-1].float() * ix.num_heads**-0.5
            index_q = num.index_(q_all[:, nh * hd :].view(rows, ix.num_heads, ix.head_dim))
        source, role = self.role.kv_source, self.role

        def compressed_keys(g: TokenGroup, pick):
            if not g.num_candidates:
                return None, None, None
            compressed = blocks.flat(source, "compressed")
            if ix is None:
                return (compressed, *shared.picks[(role.index_source, id(g))])
            flat_keys = blocks.flat(source, "indexer_keys")
            if g.shared_rows:  # one stored candidate row for the group: gather once, view per token
                keys = flat_keys.index_select(0, g.cand_rows[0]).unsqueeze(0).expand(g.cand_rows.shape[0], -1, -1)
            else:
                keys = flat_keys.index_select(0, g.cand_rows.reshape(-1)).view(-1, g.num_candidates, ix.head_dim)
            total = index_scores(pick(index_q), pick(index_w), keys, g, bi)
            if role.uses_candidates:
                total = total.masked_fill(~shared.candidates[id(g)], NEG_INF)
            if role.is_candidate_source:
                shared.candidates[id(g)] = candidate_pool(total, g.cand_valid, self.candidate_topk_blocks,
                                                          self.candidate_block_size)
            picked = top_entries(total, g, ix.top_k)
            shared.picks[(self.layer, id(g))] = picked
            return (compressed, *picked)

        return self.output(self.attend(q, kv, plan.groups, ctx, swa, compressed_keys), ctx)

    def _write_entries(self, proj, plan, blocks: BlockCache, swa: SwaArena, bi: bool) -> None:
        """Closed groups -> paged rows and index keys of this kv source; open groups -> its rings."""
        comp, gated = self.compressor, self.compressor.gate_proj is not None
        kv, gate = proj[2], proj[3] if gated else None
        ring_kv = swa.flat(self.layer, "comp_kv") if gated else None
        ring_gate = swa.flat(self.layer, "comp_gate") if gated else None
        entries = plan.entries
        if entries is not None:
            latent = comp.pool_entries(kv, gate, ring_kv, ring_gate, entries)
            keys = self.numerics.index_(self.indexer.keys(latent, entries.cos, entries.sin, bi))
            rows = self.numerics.compressed_(ops.apply_rope_(latent, entries.cos, entries.sin))
            blocks.flat(self.layer, "compressed").index_copy_(0, entries.dst_rows, rows)
            blocks.flat(self.layer, "indexer_keys").index_copy_(0, entries.dst_rows, keys)
        if gated:
            _write_ring(ring_kv, kv, plan.ring_write)
            _write_ring(ring_gate, gate, plan.ring_write)


def _no_compressed(group, pick):
    return None, None, None
