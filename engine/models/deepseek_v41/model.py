"""DeepSeek-V4.1 for serving: the block stack over V4's caches, cache declarations, logits.

Caches (same machinery as V4):
- paged block cache (prefix-cacheable): ``compressed`` rows and ``indexer_keys`` of the kv-source
  layers only; the other compressed layers read their source's;
- SWA slot: every layer's ``window`` ring, the ratio-2 kv sources' open-pair rings
  (``comp_kv``/``comp_gate``) and the Engram history (``engram_ids``, compressed ids as base-256
  digits).

``state_dict()`` keys are canonical names (V4's module names; checkpoint_names.py maps the
official ones), plus ``engram_hash.token_map`` (built from the tokenizer by the loader).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.cache.block_cache import BlockCache, PagedSpec
from deepinfer.cache.swa_state import RingSpec, SwaArena
from deepinfer.engine.models.deepseek_v4.context import Geometry, expand_groups, group_key_rows, merge_step_tokens
from deepinfer.engine.models.deepseek_v4.layers import Norm, linear_holder
from deepinfer.engine.models.deepseek_v4.mhc import HyperConnection
from deepinfer.engine.models.deepseek_v4.rope import inv_freq
from deepinfer.engine.models.deepseek_v41.attention import SharedPicks
from deepinfer.engine.models.deepseek_v41.block import DSparkStage, V41Block
from deepinfer.engine.models.deepseek_v41.config import V41Config
from deepinfer.engine.models.deepseek_v41.context import V41ForwardContext, V41Geometry
from deepinfer.engine.models.deepseek_v41.engram import NUM_DIGITS, EngramHash, digits_to_ids, ids_to_digits
from deepinfer.engine.models.deepseek_v41.numerics import Numerics
from deepinfer.kernels import ops

ENGRAM_RING = "engram_ids"


class DeepseekV41ForCausalLM(nn.Module):
    def __init__(self, config: V41Config, device=None, dtype=torch.float32, numerics: Numerics | None = None):
        super().__init__()
        c = config
        self.config, self.dtype = c, dtype
        self.numerics = numerics or Numerics()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, device=device, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([V41Block(c, role, device, dtype, numerics=self.numerics) for role in c.roles])
        self.norm = Norm(c.hidden_size, device)
        self.lm_head = linear_holder(c.hidden_size, c.vocab_size, device, dtype)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.engram_hash = EngramHash(c, device) if c.engram_layer_ids else None
        self.mtp = nn.ModuleList([DSparkStage(c, k, device, dtype) for k in range(c.num_stages)])
        # on the model's device: the DSpark drafter's pass builds its rope tables from them inside a
        # CUDA graph, where a host tensor cannot be copied (the serving forward's tables come from
        # the host geometry's copy, ``geometry()``)
        self.register_buffer("main_inv_freq", inv_freq(c.rope_main, c.qk_rope_head_dim).to(device), persistent=False)
        self.register_buffer("compress_inv_freq", inv_freq(c.rope_compress, c.qk_rope_head_dim).to(device),
                             persistent=False)
        self.decoder_from = c.ced_source  # first layer of a bounded decoder replay
        self.decoder_replay_tokens: int | None = None
        # DSpark's target features, taken inside the forward (a CUDA graph's replay keeps them; a
        # hook would not run): for each layer of ``feature_layers``, (rows, the mean over the
        # streams entering it) of the last forward, rows None for the whole batch, else the
        # bounded decoder replay's rows (dspark_serving.FeatureCapture reads them)
        self.feature_layers: frozenset[int] = frozenset()
        self.side_outputs: list[tuple[torch.Tensor | None, torch.Tensor]] = []

    # ---- cache declarations ---------------------------------------------------------------
    def compress_kinds(self) -> tuple[tuple[int, bool], ...]:
        return tuple(sorted({(r, False) for r in self.config.compress_ratios if r}))

    def paged_specs(self) -> list[PagedSpec]:
        c = self.config
        specs = []
        for role in c.roles:
            if role.is_kv_source:
                specs.append(PagedSpec(role.layer, "compressed", role.ratio, c.head_dim))
                specs.append(PagedSpec(role.layer, "indexer_keys", role.ratio, c.index_head_dim))
        return specs

    def ring_specs(self, lookahead: int) -> list[RingSpec]:
        c = self.config
        specs = []
        for role in c.roles:
            specs.append(RingSpec(role.layer, "window", c.sliding_window + lookahead, c.head_dim))
            if role.is_kv_source and role.ratio > 1:
                for name in ("comp_kv", "comp_gate"):
                    specs.append(RingSpec(role.layer, name, role.ratio + lookahead, c.head_dim))
        if c.engram_layer_ids:
            specs.append(RingSpec(c.engram_layer_ids[0], ENGRAM_RING, self._engram_capacity(lookahead), NUM_DIGITS))
        return specs

    def _engram_capacity(self, lookahead: int) -> int:
        return self.config.engram_max_ngram_size - 1 + lookahead

    def geometry(self, block_size: int, lookahead: int) -> V41Geometry:
        c = self.config
        base = Geometry(
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
        return V41Geometry(
            base=base,
            engram_ngram=c.engram_max_ngram_size if c.engram_layer_ids else 0,
            engram_capacity=self._engram_capacity(lookahead) if c.engram_layer_ids else 0,
            decoder_replay_tokens=self.decoder_replay_tokens if self.decoder_from is not None else None,
        )

    def bounded_replay(self, replay_tokens: int) -> int:
        """Bounded SWA replay (ARCHITECTURE.md, "Caches"): the decoder layers (the CED source and above) rebuild
        their windows from only the last ``replay_tokens`` replayed tokens, the layers below replay
        exactly; returns the tokens to replay (sliding_window x the layers below the CED source)."""
        c = self.config
        if self.decoder_from is None:
            return replay_tokens  # no decoder: every layer replays the bounded segment
        self.decoder_replay_tokens = replay_tokens
        return c.sliding_window * self.decoder_from

    # ---- weights ----------------------------------------------------------------------------
    def finalize(self) -> None:
        """Build fused projection weights; call after loading and moving the weights."""
        for layer in self.layers:
            layer.finalize()

    def quantize_fp8(self, scale_format: str = "float") -> None:
        """Serve the decoder stack's FP8/FP4 GEMM weights (attention q_a, kv, q_b, o_b; shared and
        routed experts) as block-scaled FP8 (V4's ``quantize_fp8``, kernels/fp8.py); Engram, the
        DSpark drafter and the vision tower stay dense. The float numerics only: the released ones
        round inputs in blocks of 32, which 128-column FP8 GEMMs do not reproduce."""
        if self.numerics.official:
            raise ValueError("FP8 weights serve V4.1's float numerics only; unset DEEPINFER_V41_NUMERICS=official")
        for layer in self.layers:
            layer.self_attn.quantize_fp8(scale_format)
            layer.mlp.quantize_fp8(scale_format)

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, ctx: V41ForwardContext, blocks: BlockCache, swa: SwaArena) -> torch.Tensor:
        """Final hidden states ``[num_logits, hidden]`` of the rows in ``ctx.logit_index``."""
        c, bi = self.config, ctx.batch_invariant
        for sub in (ctx, None if ctx.decoder is None else ctx.decoder.ctx):
            if sub is not None:
                expand_groups(sub)  # compact candidates and windows: rows / valid / bias built on the device
        embedded = F.embedding(ctx.token_ids, self.embed_tokens.weight)
        if ctx.embeds is not None:  # image spans: the vision tower's rows replace the table's
            embedded = embedded.index_copy(0, ctx.embeds.rows, ctx.embeds.values.to(embedded.dtype))
        streams = embedded[:, None, :].expand(-1, c.hc_mult, -1).contiguous()
        pre = streams.new_zeros(streams.shape[0], c.hc_mult, dtype=torch.float32)
        pre[:, 0] = 1.0  # layer 0's attention reads stream 0: the embedding
        dead = self._image_tokens(ctx)
        engram_rows = self._engram_rows(ctx, swa, dead)
        shared, here = SharedPicks(), ctx
        taps: list[tuple[torch.Tensor | None, torch.Tensor]] | None = [] if self.feature_layers else None
        for layer in self.layers:
            if here is ctx and ctx.decoder is not None and layer.self_attn.layer == self.decoder_from:
                # bounded decoder replay: from here on only the sub-batch's rows
                here, shared = ctx.decoder.ctx, SharedPicks()
                streams, pre = _rows(streams, ctx.decoder.rows, here.num_rows), _rows(pre, ctx.decoder.rows, here.num_rows)
                engram_rows = None if engram_rows is None else engram_rows.index_select(0, ctx.decoder.rows)
                dead = None if dead is None else dead.index_select(0, ctx.decoder.rows)
            if layer.engram is not None:
                streams = layer.engram(streams, engram_rows[:, layer.engram.index], here.num_tokens, bi, dead)
            if taps is not None and layer.self_attn.layer in self.feature_layers:
                rows = None if here is ctx else ctx.decoder.rows
                taps.append((rows, streams[: here.num_tokens].float().mean(dim=-2)))
            streams, pre = layer(streams, pre, here, blocks, swa, shared)
        if taps is not None:
            self.side_outputs = taps
        index = here.logit_index
        hidden = HyperConnection.collapse(streams.index_select(0, index), pre.index_select(0, index), bi)
        return ops.rms_norm(hidden, self.norm.weight, c.rms_norm_eps)

    def _image_tokens(self, ctx: V41ForwardContext) -> torch.Tensor | None:
        """``[T]`` mask of image-span tokens (dead for Engram), None without a vision tower."""
        if self.config.vision is None or self.engram_hash is None:
            return None
        return ctx.token_ids[: ctx.num_tokens] == self.config.image_token_id

    def _engram_rows(self, ctx: V41ForwardContext, swa: SwaArena, dead: torch.Tensor | None) -> torch.Tensor | None:
        """Table rows ``[T, engram layers, columns]`` of every token; updates the history ring. An
        image token is dead: it ends every n-gram that reaches it (id -1, as history is)."""
        plan = ctx.engram
        if plan is None:
            return None
        ring = swa.flat(self.config.engram_layer_ids[0], ENGRAM_RING)
        fresh = self.engram_hash.token_map.index_select(0, ctx.token_ids[: ctx.num_tokens])
        if dead is not None:
            fresh = fresh.masked_fill(dead, -1)
        history = digits_to_ids(ring.index_select(0, plan.ring_rows))
        pool = torch.cat([history, fresh, fresh.new_full((1,), -1)])
        ring.index_copy_(0, plan.ring_write.rows, ids_to_digits(fresh.index_select(0, plan.ring_write.src), ring.dtype))
        return self.engram_hash.rows(pool[plan.history])

    def compute_logits(self, hidden: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        return ops.linear(hidden, self.lm_head.weight, batch_invariant).float()


def _rows(x: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``x[rows]`` padded with zero rows to ``num_rows`` (the sub-batch's batch-invariant row count)."""
    picked = x.index_select(0, rows)
    if num_rows == picked.shape[0]:
        return picked
    return torch.cat([picked, picked.new_zeros(num_rows - picked.shape[0], *picked.shape[1:])])
