"""DeepSeek-V4 for serving: decoder stack, cache declarations, logits.

``state_dict()`` keys are the canonical tensor names (transformers' ``DeepseekV4ForCausalLM``
names without the leading ``model.``, plus ``lm_head.weight``); rotary tables are not state.
Forward takes a ``ForwardContext`` (engine/models/deepseek_v4/context.py) and the two caches and
returns the final hidden rows of the tokens that want logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.cache.block_cache import BlockCache, PagedSpec
from deepinfer.cache.swa_state import RingSpec, SwaArena
from deepinfer.engine.models.deepseek_v4.attention import Attention
from deepinfer.engine.models.deepseek_v4.config import ModelConfig
from deepinfer.engine.models.deepseek_v4.context import (
    ForwardContext,
    Geometry,
    expand_groups,
    group_key_rows,
    merge_step_tokens,
)
from deepinfer.engine.models.deepseek_v4.layers import Norm, linear_holder
from deepinfer.engine.models.deepseek_v4.mhc import HyperConnection, HyperHead
from deepinfer.engine.models.deepseek_v4.moe import MoE
from deepinfer.engine.models.deepseek_v4.rope import inv_freq
from deepinfer.kernels import cpu_gemm, ops


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, device=None, dtype=None):
        super().__init__()
        c = config
        hc = dict(sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps, device=device)
        self.eps = c.rms_norm_eps
        self.self_attn = Attention(c, layer, device, dtype)
        self.mlp = MoE(c, layer, device, dtype)
        self.input_layernorm = Norm(c.hidden_size, device)
        self.post_attention_layernorm = Norm(c.hidden_size, device)
        self.attn_hc = HyperConnection(c.hc_mult, c.hidden_size, **hc)
        self.ffn_hc = HyperConnection(c.hc_mult, c.hidden_size, **hc)

    def forward(self, streams: torch.Tensor, ctx: ForwardContext, blocks: BlockCache, swa: SwaArena) -> torch.Tensor:
        bi = ctx.batch_invariant
        # CPU: mHC weights + block norm (and the attention's stream update) in one native call each
        fused = cpu_gemm.hc_post_pre(None, streams, None, None, self.attn_hc, self.input_layernorm.weight, self.eps)
        if fused is not None:
            _, post, comb, x = fused
            out = self.self_attn.forward(x, ctx, blocks, swa)
            streams, post, comb, x = cpu_gemm.hc_post_pre(
                out, streams, post, comb, self.ffn_hc, self.post_attention_layernorm.weight, self.eps
            )
            out = self.mlp.forward(x, ctx.token_ids, ctx.num_tokens, bi)
            return HyperConnection.post(out, streams, post, comb, bi)
        post, comb, x = self.attn_hc.pre(streams, bi)
        out = self.self_attn.forward(ops.rms_norm(x, self.input_layernorm.weight, self.eps), ctx, blocks, swa)
        streams = HyperConnection.post(out, streams, post, comb, bi)
        post, comb, x = self.ffn_hc.pre(streams, bi)
        x = ops.rms_norm(x, self.post_attention_layernorm.weight, self.eps)
        out = self.mlp.forward(x, ctx.token_ids, ctx.num_tokens, bi)
        return HyperConnection.post(out, streams, post, comb, bi)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=torch.float32):
        super().__init__()
        c = config
        if c.num_attention_heads * c.head_dim % c.o_groups:
            raise ValueError(f"num_attention_heads * head_dim must divide into o_groups ({c.o_groups})")
        if c.qk_rope_head_dim > min(c.head_dim, c.index_head_dim) or c.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {c.qk_rope_head_dim} must be even and fit head_dim and index_head_dim")
        self.config = c
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, device=device, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([DecoderLayer(c, i, device, dtype) for i in range(c.num_hidden_layers)])
        self.norm = Norm(c.hidden_size, device)
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps, device=device)
        self.lm_head = linear_holder(c.hidden_size, c.vocab_size, device, dtype)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # on the model's device like every other tensor it holds (the forward's rope tables come
        # from the host geometry's copy, ``geometry()``)
        self.register_buffer("main_inv_freq", inv_freq(c.rope_main, c.qk_rope_head_dim).to(device), persistent=False)
        self.register_buffer("compress_inv_freq", inv_freq(c.rope_compress, c.qk_rope_head_dim).to(device),
                             persistent=False)

    # ---- cache declarations ---------------------------------------------------------------
    def compress_kinds(self) -> tuple[tuple[int, bool], ...]:
        kinds = {(layer.self_attn.ratio, layer.self_attn.is_csa) for layer in self.layers if layer.self_attn.ratio}
        return tuple(sorted(kinds))

    def paged_specs(self) -> list[PagedSpec]:
        c, specs = self.config, []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if attn.ratio:
                specs.append(PagedSpec(i, "compressed", attn.ratio, c.head_dim))
                if attn.is_csa:
                    specs.append(PagedSpec(i, "indexer_keys", attn.ratio, c.index_head_dim))
        return specs

    def ring_specs(self, lookahead: int) -> list[RingSpec]:
        c, specs = self.config, []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            specs.append(RingSpec(i, "window", c.sliding_window + lookahead, c.head_dim))
            if attn.ratio:
                span = 2 * attn.ratio if attn.is_csa else attn.ratio
                names = [("comp", attn.compressor.width)]
                if attn.is_csa:
                    names.append(("index", attn.indexer.width))
                for prefix, width in names:
                    specs.append(RingSpec(i, f"{prefix}_kv", span + lookahead, width))
                    specs.append(RingSpec(i, f"{prefix}_gate", span + lookahead, width))
        return specs

    def geometry(self, block_size: int, lookahead: int) -> Geometry:
        c = self.config
        return Geometry(
            sliding_window=c.sliding_window,
            window_capacity=c.sliding_window + lookahead,
            block_size=block_size,
            lookahead=lookahead,
            vocab_size=c.vocab_size,
            compress_kinds=self.compress_kinds(),
            inv_freq={"main": self.main_inv_freq.cpu(), "compress": self.compress_inv_freq.cpu()},
            max_group_key_rows=group_key_rows(self.embed_tokens.weight.device),
            merge_step_tokens=merge_step_tokens(self.embed_tokens.weight.device),
            compact_candidates=self.embed_tokens.weight.device.type != "cpu",
        )

    # ---- weights ----------------------------------------------------------------------------
    def finalize(self) -> None:
        """Build fused projection weights; call after loading and moving the weights."""
        for layer in self.layers:
            layer.self_attn.finalize()
            layer.mlp.finalize()
            layer.attn_hc.finalize()
            layer.ffn_hc.finalize()
        if self.embed_tokens.weight.is_cuda:
            ops.use_gpu()  # the Triton kernels take this model's CUDA tensors (kernels/gpu_routing.py)

    def quantize_fp8(self, scale_format: str = "ue8m0") -> None:
        """Serve the GEMM weights DeepSeek's checkpoints store in FP8 or FP4 (attention q_a, kv,
        q_b, o_b, the shared and routed experts) as block-scaled FP8 (kernels/fp8.py), dropping
        their dense copies; call after ``finalize``. "ue8m0" scales give back an FP8 checkpoint's
        own values exactly (the loader dequantised them to the compute dtype)."""
        for layer in self.layers:
            layer.self_attn.quantize_fp8(scale_format)
            layer.mlp.quantize_fp8(scale_format)

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, ctx: ForwardContext, blocks: BlockCache, swa: SwaArena) -> torch.Tensor:
        """Final hidden states ``[num_logits, hidden]`` of the rows in ``ctx.logit_index``."""
        expand_groups(ctx)  # compact candidates and windows: rows / valid / bias built on the device
        x = F.embedding(ctx.token_ids, self.embed_tokens.weight)
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer.forward(streams, ctx, blocks, swa)  # no hooks: skip Module.__call__
        streams = streams.index_select(0, ctx.logit_index)
        hidden = self.hc_head.forward(streams, ctx.batch_invariant)
        return ops.rms_norm(hidden, self.norm.weight, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        return ops.linear(hidden, self.lm_head.weight, batch_invariant).float()
