"""V4 attention over the serving caches: shared-KV MQA with sink, sliding window + compressed KV.

Per token t (head_dim D, the last ``rope_dim`` channels rotate):
  q = rope(rms(q_b(rms(q_a(h)))) per head),   kv = rope(kv_norm(kv_proj(h)))   (K = V)
  keys = its window rows [t-W+1, t] + compressed entries (HCA: all closed; CSA: indexer top-k)
  out  = softmax([q.k * D^-0.5 ..., sink]) @ keys, un-rotated at t, then the grouped low-rank
         output projection (o_a per head group, o_b across groups).

Cache traffic per layer, in this order: closed windows' entries -> block cache; fresh compressor
rows -> compressor rings; window pool gathered; fresh kv rows -> window ring; attention reads
the pool and the block cache.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.cache.block_cache import BlockCache
from deepinfer.cache.swa_state import SwaArena
from deepinfer.engine.models.deepseek_v4.compressor import Compressor, Indexer
from deepinfer.engine.models.deepseek_v4.config import ModelConfig
from deepinfer.engine.models.deepseek_v4.context import ForwardContext, RingWrite
from deepinfer.engine.models.deepseek_v4.layers import Norm, fuse_linears, linear_holder, release_weights
from deepinfer.kernels import cpu_gemm, cpu_native, ops
from deepinfer.kernels.fp8 import Fp8Weight


def _write_ring(ring: torch.Tensor, fresh: torch.Tensor, write: RingWrite) -> None:
    if not cpu_native.ring_write(ring, fresh, write.rows, write.src):
        ring.index_copy_(0, write.rows, fresh.index_select(0, write.src))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, device=None, dtype=None, *, q_head_norm: bool = True,
                 with_compressor: bool = True):
        """``q_head_norm``: V4 RMS-normalises each query head (weightless); V4.1 does not.
        ``with_compressor``: build V4's compressor/indexer for compressed layers (a model
        with its own compressed-KV scheme passes False and overrides ``input_linears``)."""
        super().__init__()
        c = config
        self.layer = layer
        self.q_head_norm = q_head_norm
        self.num_heads, self.head_dim, self.eps = c.num_attention_heads, c.head_dim, c.rms_norm_eps
        self.sliding_window = c.sliding_window
        self.o_groups, self.o_lora_rank = c.o_groups, c.o_lora_rank
        self.ratio = c.compress_ratio(layer)
        self.is_csa = with_compressor and self.ratio > 0 and c.layer_types[layer] == "compressed_sparse_attention"
        self.rope_name = "compress" if self.ratio else "main"
        h, hd = c.hidden_size, c.head_dim
        self.q_a_proj = linear_holder(h, c.q_lora_rank, device, dtype)
        self.q_a_norm = Norm(c.q_lora_rank, device)
        self.q_b_proj = linear_holder(c.q_lora_rank, c.num_attention_heads * hd, device, dtype)
        self.kv_proj = linear_holder(h, hd, device, dtype)
        self.kv_norm = Norm(hd, device)
        self.o_a_proj = linear_holder(c.num_attention_heads * hd // c.o_groups, c.o_groups * c.o_lora_rank, device, dtype)
        self.o_b_proj = linear_holder(c.o_groups * c.o_lora_rank, h, device, dtype)
        self.sinks = nn.Parameter(torch.empty(c.num_attention_heads, device=device, dtype=torch.float32), requires_grad=False)
        self.compressor: Compressor | None = None
        if self.ratio and with_compressor:
            self.compressor = Compressor(h, hd, self.ratio, self.is_csa, c.rms_norm_eps, device, dtype)
            if self.is_csa:
                self.compressor.indexer = Indexer(
                    h, c.q_lora_rank, c.index_n_heads, c.index_head_dim, self.ratio, c.index_topk,
                    c.rms_norm_eps, device, dtype,
                )  # fmt: skip
        # the GEMM weights forward reads (finalize; quantize_fp8 swaps some for Fp8Weight)
        self.w_in: torch.Tensor | None = None
        self.w_in_fp8: Fp8Weight | None = None  # with FP8 weights: q_a and kv rows; w_in holds the rest
        self.in_sizes: list[int] = []
        self.w_qb: torch.Tensor | Fp8Weight | None = None
        self.w_o_a: torch.Tensor | None = None
        self.w_o_b: torch.Tensor | Fp8Weight | None = None

    @property
    def indexer(self) -> Indexer | None:
        return self.compressor.indexer if self.is_csa else None

    def input_linears(self) -> list[nn.Linear]:
        """Projections that read the attention input ``h``: q_a and kv first, then the compressed-KV
        side (one fused GEMM; ``project`` splits its columns in this order)."""
        inputs = [self.q_a_proj, self.kv_proj]
        if self.compressor is not None:
            inputs += self.compressor.input_linears()
        if self.indexer is not None:
            inputs += self.indexer.input_linears()
        return inputs

    def q_b_linears(self) -> list[nn.Linear]:
        """Projections that read the normed q_a output: q_b first, then the indexer's query."""
        return [self.q_b_proj] + ([self.indexer.q_b_proj] if self.indexer is not None else [])

    def finalize(self) -> None:
        """Fuse the projections that read the same input (call once weights are in place)."""
        self.w_in, self.in_sizes = fuse_linears(self.input_linears())
        self.w_qb, _ = fuse_linears(self.q_b_linears())
        # one stable view: the native GEMM caches its packed weights on the tensor object
        self.w_o_a = self.o_a_proj.weight.view(self.o_groups, self.o_lora_rank, -1)
        self.w_o_b = self.o_b_proj.weight.detach()  # a plain tensor (an attribute, not a second parameter)

    def quantize_fp8(self, scale_format: str) -> None:
        """Serve the projections DeepSeek's checkpoints store in FP8 (q_a, kv, q_b, the indexer's
        q_b, o_b) as block-scaled FP8 (kernels/fp8.py); the rest of the input projections (the
        compressor's and indexer's) and o_a stay in the compute dtype. Call after ``finalize``."""
        inputs = self.input_linears()
        self.w_in_fp8 = Fp8Weight.quantize(self.w_in[: sum(self.in_sizes[:2])], scale_format)
        self.w_in = fuse_linears(inputs[2:])[0] if len(inputs) > 2 else None
        self.w_qb = Fp8Weight.quantize(self.w_qb, scale_format)
        self.w_o_b = Fp8Weight.quantize(self.w_o_b, scale_format)
        release_weights(inputs[:2] + self.q_b_linears() + [self.o_b_proj])

    def forward(self, h: torch.Tensor, ctx: ForwardContext, blocks: BlockCache, swa: SwaArena) -> torch.Tensor:
        """``h [R, hidden]`` (R = ctx.num_rows) -> ``[R, hidden]``; only rows < T attend."""
        bi, rows, nh, hd = ctx.batch_invariant, ctx.num_rows, self.num_heads, self.head_dim
        ix = self.indexer
        index_tables = () if ix is None else (ix.num_heads, ix.head_dim, *ctx.rope["compress"].tables())
        proj, q_all, q, kv = self.project(h, ctx, index_tables)
        index_q = index_w = None
        if self.compressor is not None:
            plan = ctx.compress[(self.ratio, self.is_csa)]
            self._compress(self.compressor, proj[2], proj[3], plan, blocks, swa, "comp", "compressed")
            if ix is not None:
                self._compress(ix, proj[4], proj[5], plan, blocks, swa, "index", "indexer_keys")
                index_w = proj[6].float() * ix.num_heads**-0.5
                index_q = q_all[:, nh * hd :].view(rows, ix.num_heads, ix.head_dim)
            groups = plan.groups
        else:
            groups = ctx.window.groups
        layer = self.layer

        def compressed_keys(g, pick):
            if not g.num_candidates:
                return None, None, None
            if ix is None or (g.num_candidates <= ix.top_k and not g.cand_rows.is_cpu):
                # HCA, or an indexer that would keep every candidate: nothing to score (off the CPU
                # only: there the order of the picks is part of the numbers)
                return blocks.flat(layer, "compressed"), g.cand_rows, g.cand_bias
            flat_keys = blocks.flat(layer, "indexer_keys")
            if g.shared_rows:  # one step's candidates for every token: gathered once, viewed per token
                keys = flat_keys.index_select(0, g.cand_rows[0]).unsqueeze(0).expand(g.cand_rows.shape[0], -1, -1)
            else:
                keys = flat_keys.index_select(0, g.cand_rows.reshape(-1)).view(-1, g.num_candidates, flat_keys.shape[-1])
            cand_rows, cand_bias = ix.select(pick(index_q), pick(index_w), keys, g, bi)
            return blocks.flat(layer, "compressed"), cand_rows, cand_bias

        out = self.attend(q, kv, groups, ctx, swa, compressed_keys)
        return self.output(out, ctx)

    def project(self, h: torch.Tensor, ctx: ForwardContext, index_tables: tuple = ()):
        """(proj columns split by ``in_sizes``, q_all, q [R, nh, hd] rotated, kv [R, hd] rotated).

        ``index_tables`` = (index heads, index head dim, cos, sin): the indexer's query heads in
        q_all are rotated in place with those tables (CPU: in the same native call)."""
        bi, rows, nh, hd = ctx.batch_invariant, ctx.num_rows, self.num_heads, self.head_dim
        rope = ctx.rope[self.rope_name]
        # CPU: projections, norms and rotations in one native call (bitwise the ops below); it
        # always normalises the query heads, so a model without that norm takes the ops
        fused = None
        if self.q_head_norm and self.w_in_fp8 is None:
            fused = cpu_gemm.attention_inputs(
                h, self.w_in, self.in_sizes[0], self.q_a_norm.weight, self.w_qb, self.kv_norm.weight, self.eps, nh, hd,
                rope.cos, rope.sin, *index_tables,
            )  # fmt: skip
        if fused is not None:
            proj, q_all, q, kv = fused
            return proj.split(self.in_sizes, dim=-1), q_all, q, kv
        if self.w_in_fp8 is None:
            proj = ops.linear(h, self.w_in, bi).split(self.in_sizes, dim=-1)
        else:
            proj = ops.linear(h, self.w_in_fp8, bi).split(self.in_sizes[:2], dim=-1)
            if self.w_in is not None:
                proj += ops.linear(h, self.w_in, bi).split(self.in_sizes[2:], dim=-1)
        q_all = ops.linear(ops.rms_norm(proj[0], self.q_a_norm.weight, self.eps), self.w_qb, bi)
        q = q_all[:, : nh * hd].reshape(rows, nh, hd)
        if self.q_head_norm:  # norm + rotation: one launch where a backend fuses them (GPU)
            q = ops.rms_norm_rope(q, None, self.eps, rope.cos, rope.sin)
        else:
            q = ops.apply_rope_(q.contiguous(), rope.cos, rope.sin)
        kv = ops.rms_norm_rope(proj[1], self.kv_norm.weight, self.eps, rope.cos, rope.sin)
        if index_tables:
            heads, dim, cos, sin = index_tables
            ops.apply_rope_(q_all[:, nh * hd :].view(rows, heads, dim), cos, sin)
        return proj, q_all, q, kv

    def attend(self, q: torch.Tensor, kv: torch.Tensor, groups, ctx: ForwardContext, swa: SwaArena,
               compressed_keys) -> torch.Tensor:
        """Attention of every token over its window rows (+ compressed keys): ``[R, nh, hd]``.

        ``compressed_keys(group, pick)`` gives (paged rows, row ids [G, k], bias [G, 1, k]) of a
        group's compressed keys, or Nones; ``pick(x)`` selects the group's rows of a per-token
        tensor. The window ring of this layer is read for the pool and then updated with ``kv``."""
        bi, rows, t, layer = ctx.batch_invariant, ctx.num_rows, ctx.num_tokens, self.layer
        hd, nh = self.head_dim, self.num_heads
        window_ring, win = swa.flat(layer, "window"), ctx.window
        # pool = [ring rows before each step | fresh rows | zero row for the sink]; the SIMD CPU
        # kernel reads it in place (the fresh rows reach the ring after the last group), else
        # it is built before the ring write
        in_place = ring_pending = cpu_gemm.usable(q, window_ring)
        if not in_place:
            pool = cpu_native.window_pool(window_ring, win.ring_rows, kv, win.ring_write.rows, win.ring_write.src)
            if pool is None:
                pool = torch.cat([window_ring.index_select(0, win.ring_rows), kv, kv.new_zeros(1, hd)])
                _write_ring(window_ring, kv, win.ring_write)

        whole = len(groups) == 1 and groups[0].token_index is None
        out = None if whole and rows == t else q.new_zeros(rows, nh, hd)
        for g in groups:
            sel = g.token_index
            pick = (lambda x: x[:t]) if sel is None else (lambda x: x.index_select(0, sel))
            qg = pick(q)
            num = qg.shape[0]
            compressed, cand_rows, cand_bias = compressed_keys(g, pick)
            win_rows = g.win_index.view(num, g.window_len + 1)
            part = None
            if in_place:
                part = cpu_native.window_attention(qg, window_ring, win.ring_rows, kv, win_rows, g.win_bias, compressed,
                                                   cand_rows, cand_bias, self.sinks, hd**-0.5)  # fmt: skip
                if part is None:  # a layout the kernel does not take: build the pool after all
                    in_place = False
                    pool = torch.cat([window_ring.index_select(0, win.ring_rows), kv, kv.new_zeros(1, hd)])
            if part is None:
                part = ops.gathered_attention(
                    qg, pool, win_rows, g.win_bias, compressed, cand_rows, cand_bias, self.sinks, hd**-0.5, bi
                )
            if out is None:
                out = part
            elif sel is None:
                out[:t] = part
            else:
                out.index_copy_(0, sel, part)

        if ring_pending:
            _write_ring(window_ring, kv, win.ring_write)
        return out

    def output(self, out: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Un-rotate the attention output and apply the grouped low-rank output projection."""
        bi, rows, rope = ctx.batch_invariant, ctx.num_rows, ctx.rope[self.rope_name]
        fused_out = cpu_gemm.attention_outputs(out, rope.cos, rope.neg_sin, self.w_o_a, self.w_o_b)
        if fused_out is not None:
            return fused_out
        ops.apply_rope_(out, rope.cos, rope.neg_sin)  # undo the rotation V carried on its rope channels
        mixed = ops.grouped_linear(out.view(rows, self.o_groups, -1), self.w_o_a, bi).reshape(rows, -1)
        return ops.linear(mixed, self.w_o_b, bi)

    def _compress(self, comp: Compressor, kv, gate, plan, blocks: BlockCache, swa: SwaArena, ring: str, paged: str):
        ring_kv, ring_gate = swa.flat(self.layer, f"{ring}_kv"), swa.flat(self.layer, f"{ring}_gate")
        if plan.entries is not None:
            entries = comp.close_entries(kv, gate, ring_kv, ring_gate, plan.entries)
            blocks.flat(self.layer, paged).index_copy_(0, plan.entries.dst_rows, entries)
        _write_ring(ring_kv, kv, plan.ring_write)
        _write_ring(ring_gate, gate, plan.ring_write)
