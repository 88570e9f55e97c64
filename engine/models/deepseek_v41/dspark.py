"""The DSpark drafter of a V4.1 model: its ``mtp.K`` stages, Markov head and confidence head, as one module.

A draft step after the target produced token ``y`` at position ``p + 1`` (its context: positions
0..p) drafts ``K = dspark_block_size`` tokens for positions p + 2 .. p + K + 1:

    features   mean over the 4 streams of the residual entering each target layer
               (``dspark_target_layer_ids``), concatenated: ``[.., S * D]``
    main_x     ``main_norm(main_proj(features))`` (stage 0's tensors)
    context    each stage's ``kv_norm(kv_proj(main_x))``, rotated at its target position (plain
               RoPE): the KV injected into the stage's window (the last ``sliding_window``
               positions up to p)
    block      ids ``[y, noise x (K - 1)]`` at positions p + 1 .. p + K, embedded with the target's
               embedding (4 identical streams, identity pre), through every stage: window
               attention over [context | all K block keys] (non-causal inside the block), MoE,
               single-pass mHC; ``h`` = the collapse with the last stage's FFN pre
    drafts     ``U = head(norm(h))`` once; then for k = 0 .. K-1, with ``prev_0 = y`` and
               ``prev_k = d_k``: ``d_{k+1} = argmax(U_k + markov_head(prev_k))`` (or a sample)
    confidence ``c_k = sigmoid(proj([h_k ; markov_embed(prev_k)]) / T_k)``: the probability that
               d_{k+1} is accepted given d_1..d_k were; ``T_k`` per-position temperatures
               calibrated on held-out text (``dspark_calibration.json`` beside the checkpoint)

API (plain tensors; autograd runs through every stage, the target's embed/head are read detached):

    main_x = drafter.inject(features)                          # [..., S*D] -> [..., D]
    ctx = drafter.context_kv(main_x, positions)                # [stages, ..., hd]
    h = drafter.block(block_ids, positions, ctx_kv, ctx_valid) # [N, K] ids/positions,
                                                               # ctx_kv [stages, N, C, hd], ctx_valid [N, C]
    U = drafter.base_logits(h)                                 # [N, K, V]
    bias = drafter.markov_bias(prev)                           # [N, K] -> [N, K, V]
    logit = drafter.confidence_logits(h, prev)                 # [N, K] (pre-sigmoid, uncalibrated)
    d = drafter.draft(h, y)                                    # greedy chain: d.tokens [N, K], d.confidence

The module owns no weights of its own: it wraps the model's ``mtp`` stages (registered here,
shared with the model) and reads the target's embedding and head from the model it was built on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.models.deepseek_v41 import dense_ops as D
from deepinfer.kernels import torch_ref as ref

CALIBRATION_FILE = "dspark_calibration.json"


class Drafts(NamedTuple):
    tokens: torch.Tensor  # [N, K] drafted ids
    logits: torch.Tensor  # [N, K] confidence logits (uncalibrated)
    confidence: torch.Tensor  # [N, K] calibrated c_k


class DSparkDrafter(nn.Module):
    def __init__(self, model):
        super().__init__()
        c = model.config
        if not c.num_stages:
            raise ValueError("the model has no DSpark stages (num_nextn_predict_layers is 0)")
        self.config = c
        self.stages = model.mtp
        self._target = (model,)  # a tuple: the target is read, not registered as a submodule
        self.block_size = c.dspark_block_size
        self.noise_id = c.dspark_noise_token_id
        self.temperatures: torch.Tensor | None = None  # [K] confidence temperatures (None: 1)

    @property
    def target(self):
        return self._target[0]

    # ---- context ------------------------------------------------------------------------------
    def inject(self, features: torch.Tensor) -> torch.Tensor:
        first = self.stages[0]
        x = features.to(first.main_proj.weight.dtype) @ first.main_proj.weight.t()
        return ref.rms_norm(x, first.main_norm.weight, self.config.rms_norm_eps)

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``main_x [..., D]`` at ``positions [...]`` -> every stage's rotated K=V rows ``[stages, ..., hd]``."""
        cos, sin = D.rope_tables(positions, self.target.main_inv_freq)
        rows = []
        for stage in self.stages:
            a = stage.self_attn
            rows.append(D.rope(ref.rms_norm(main_x @ a.kv_proj.weight.t(), a.kv_norm.weight, a.eps), cos, sin))
        return torch.stack(rows)

    # ---- the block ----------------------------------------------------------------------------
    def block_ids(self, y: torch.Tensor) -> torch.Tensor:
        """``y [N]`` -> ``[N, K]``: y then noise tokens."""
        ids = y.new_full((y.shape[0], self.block_size), self.noise_id)
        ids[:, 0] = y
        return ids

    def block(self, block_ids: torch.Tensor, positions: torch.Tensor, ctx_kv: torch.Tensor,
              ctx_valid: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden ``h [N, K, D]`` of every block slot (module docstring)."""
        c, target = self.config, self.target
        n, k = block_ids.shape
        streams = D.embed(target.embed_tokens.weight.detach(), block_ids, c.hc_mult)
        pre = torch.zeros(n, k, c.hc_mult, device=block_ids.device)
        pre[..., 0] = 1.0
        cos, sin = D.rope_tables(positions, target.main_inv_freq)
        allowed = torch.cat([ctx_valid[:, None, :].expand(n, k, -1),
                             torch.ones(n, k, k, dtype=torch.bool, device=block_ids.device)], dim=-1)
        for s, stage in enumerate(self.stages):
            attn = stage.self_attn

            def attention(x, attn=attn, ctx=ctx_kv[s]):
                q, kv, _ = D.attention_inputs(attn, x, cos, sin)
                out = D.sink_attention(q, torch.cat([ctx, kv], dim=1), allowed, attn.sinks, attn.head_dim**-0.5)
                return D.attention_output(attn, out, cos, sin)

            streams, pre, _ = D.run_block(stage, streams, pre, attention, c.rms_norm_eps)
        return D.collapse(streams, pre)

    # ---- heads --------------------------------------------------------------------------------
    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        last = self.stages[-1]
        normed = ref.rms_norm(h, last.norm.weight, self.config.rms_norm_eps)
        return (normed @ self.target.lm_head.weight.detach().t()).float()

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        return F.embedding(prev, self.stages[-1].markov_head.embed.weight)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """Rank-r bigram bias ``head @ embed[prev]`` ``[..., V]``."""
        return (self.markov_embed(prev) @ self.stages[-1].markov_head.head.weight.t()).float()

    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """``proj([h ; markov_embed(prev)])`` ``[...]`` before the sigmoid and the calibration."""
        x = torch.cat([h, self.markov_embed(prev).to(h.dtype)], dim=-1)
        return (x @ self.stages[-1].confidence_head.proj.weight.t()).float().squeeze(-1)

    def calibrated(self, logits: torch.Tensor) -> torch.Tensor:
        """``sigmoid(logit_k / T_k)`` over the last dim (slots 0..K-1)."""
        if self.temperatures is None:
            return torch.sigmoid(logits)
        return torch.sigmoid(logits / self.temperatures.to(logits.device)[: logits.shape[-1]])

    @torch.no_grad()
    def draft(self, h: torch.Tensor, y: torch.Tensor, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Drafts:
        """Drafts from the block's ``h [N, K, D]`` and ``y [N]``: sequential through the Markov head
        (greedy at temperature 0, else sampled), with their confidences."""
        base = self.base_logits(h)
        prev, drafts, logits = y, [], []
        for k in range(h.shape[1]):
            logits.append(self.confidence_logits(h[:, k], prev))
            scores = base[:, k] + self.markov_bias(prev)
            if temperature > 0:
                probs = torch.softmax(scores / temperature, dim=-1)
                prev = torch.multinomial(probs, 1, generator=generator)[:, 0]
            else:
                prev = scores.argmax(dim=-1)
            drafts.append(prev)
        conf = torch.stack(logits, dim=1)
        return Drafts(torch.stack(drafts, dim=1), conf, self.calibrated(conf))


def context_windows(t: int, anchors: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Context rows of draft anchors: for anchor p (the last context position) the positions
    p - window + 1 .. p -> (index [N, window] clamped at 0, valid [N, window])."""
    offsets = torch.arange(window - 1, -1, -1, device=anchors.device)
    pos = anchors[:, None] - offsets[None, :]
    return pos.clamp(0, t - 1), pos >= 0
