"""One V4.1 block (and DSpark stage): Engram at the entry, attention and MoE under single-pass mHC.

Single pass: a sublayer computes its mHC weights (pre, post, comb) from the streams it receives
but reads the streams collapsed with the *previous* sublayer's pre (layer 0's attention: stream 0,
the embedding); its own pre is handed on. So attention uses the pre of the previous layer's FFN
and the FFN the pre of this layer's attention; the model's final collapse takes the last FFN's.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.cache.block_cache import BlockCache
from deepinfer.cache.swa_state import SwaArena
from deepinfer.engine.models.deepseek_v4.context import ForwardContext
from deepinfer.engine.models.deepseek_v4.layers import Norm, linear_holder
from deepinfer.engine.models.deepseek_v4.mhc import HyperConnection
from deepinfer.engine.models.deepseek_v4.moe import MoE
from deepinfer.engine.models.deepseek_v41.attention import SharedPicks, V41Attention
from deepinfer.engine.models.deepseek_v41.engram import Engram
from deepinfer.engine.models.deepseek_v41.numerics import Numerics
from deepinfer.engine.models.deepseek_v41.official_moe import OfficialMoE
from deepinfer.engine.models.deepseek_v41.roles import LayerRole
from deepinfer.kernels import ops


class V41Block(nn.Module):
    def __init__(self, config, role: LayerRole, device=None, dtype=None, *, moe_config=None,
                 numerics: Numerics | None = None):
        super().__init__()
        c = config
        hc = dict(sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps, device=device)
        self.eps = c.rms_norm_eps
        numerics = numerics or Numerics()
        self.self_attn = V41Attention(c, role, device, dtype, numerics)
        # image-span tokens of the backbone choose experts with their own bias (the drafts are text)
        image = c.image_token_id if c.vision is not None and role.layer < c.num_hidden_layers else None
        self.mlp = (OfficialMoE if numerics.official else MoE)(moe_config or c, role.layer, device, dtype, image)
        self.input_layernorm = Norm(c.hidden_size, device)
        self.post_attention_layernorm = Norm(c.hidden_size, device)
        self.attn_hc = HyperConnection(c.hc_mult, c.hidden_size, **hc)
        self.ffn_hc = HyperConnection(c.hc_mult, c.hidden_size, **hc)
        self.engram = None
        if role.has_engram:
            self.engram = Engram(c, list(c.engram_layer_ids).index(role.layer), device, dtype, numerics)

    def finalize(self) -> None:
        self.self_attn.finalize()
        self.mlp.finalize()
        self.attn_hc.finalize()
        self.ffn_hc.finalize()

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, ctx: ForwardContext, blocks: BlockCache,
                swa: SwaArena, shared: SharedPicks) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams [R, hc, D], pre of the previous sublayer [R, hc]) -> (streams, this FFN's pre)."""
        bi = ctx.batch_invariant
        attn_pre, post, comb = self.attn_hc.weights(streams, bi)
        x = ops.rms_norm(HyperConnection.collapse(streams, pre, bi), self.input_layernorm.weight, self.eps)
        out = self.self_attn(x, ctx, blocks, swa, shared)
        streams = HyperConnection.post(out, streams, post, comb, bi)
        ffn_pre, post, comb = self.ffn_hc.weights(streams, bi)
        x = ops.rms_norm(HyperConnection.collapse(streams, attn_pre, bi), self.post_attention_layernorm.weight, self.eps)
        out = self.mlp.forward(x, ctx.token_ids, ctx.num_tokens, bi)
        return HyperConnection.post(out, streams, post, comb, bi), ffn_pre


class DSparkStage(V41Block):
    """A DSpark draft stage (``mtp.K``): a window-only block with a 128-expert MoE; stage 0 also
    projects the target's hidden states (``main_proj``, ``main_norm``), the last one carries the
    heads (``norm``, Markov head, confidence head). Loaded here; the drafter runs them ([dspark])."""

    def __init__(self, config, stage: int, device=None, dtype=None):
        c = config
        layer = c.num_hidden_layers + stage
        role = LayerRole(layer, 0, None, None, False, False, False)
        super().__init__(c, role, device, dtype, moe_config=c.stage_moe_config())
        h = c.hidden_size
        self.main_proj = self.main_norm = self.norm = self.markov_head = self.confidence_head = None
        if stage == 0:
            self.main_proj = linear_holder(h * len(c.dspark_target_layer_ids), h, device, dtype)
            self.main_norm = Norm(h, device)
        if stage == c.num_stages - 1:
            self.norm = Norm(h, device)
            self.markov_head = nn.Module()
            self.markov_head.embed = linear_holder(c.dspark_markov_rank, c.vocab_size, device, dtype)
            self.markov_head.head = linear_holder(c.dspark_markov_rank, c.vocab_size, device, dtype)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = linear_holder(h + c.dspark_markov_rank, 1, device, dtype)
