"""The DSpark drafter in serving: the target's features taken from its forward, a batch of drafts.

engine/spec/ drafts through the ``DraftModel`` seam (engine/spec/draft_model.py); this is V4.1's:

    capture   the target's forward keeps, for the layers ``dspark_target_layer_ids``, the mean
              over the 4 streams of the residual entering each (after Engram, as
              dense_forward.py's training features), for every real row of the last forward
              (``model.feature_layers``; CUDA graphs hand back their replay's copies)
    context   ``context_rows(features, positions)``: every stage's injected K=V row of those
              positions (``DSparkDrafter.inject`` + ``context_kv``), for the engine's context ring
    propose   ``propose(y, anchors, ctx_kv, ctx_valid)``: the block ``[y, noise x (K - 1)]`` at
              positions anchor + 1 .. anchor + K through the stages, then the greedy Markov chain
              with calibrated confidences (``DSparkDrafter.draft``'s math)

The stages run on the serving modules (native mHC weights, the fused MoE, ``ops.linear``) rather
than dense_ops' autograd functions: same math, several times faster on a CPU, where the drafter's
pass is a cost every decode step pays. Attention stays dense_ops' (a K-token block over a window
of context rows: no cache, no kernel to share). Numerics may differ from training's in the last
bits; drafts only ever change speed, never outputs (verification is exact).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from deepinfer.engine.models.deepseek_v4.mhc import HyperConnection
from deepinfer.engine.models.deepseek_v41 import dense_ops as D
from deepinfer.engine.models.deepseek_v41.dspark import CALIBRATION_FILE, DSparkDrafter, Drafts
from deepinfer.kernels import ops


class FeatureCapture:
    """The DSpark target features of every real row of the model's last forward.

    The forward itself keeps them (the model's ``feature_layers`` / ``side_outputs``; a CUDA
    graph's replay hands its copies back, engine/core/cuda_graphs.py), so forwards with DSpark on
    are graphed like any other. ``take()`` -> (rows, features): ``features [n, targets * hidden]``
    float32; ``rows`` None when they are the forward's rows 0..n-1, else the batch rows they belong
    to (a bounded decoder replay runs the layers from the CED source on a sub-batch; rows outside
    it have none)."""

    def __init__(self, model) -> None:
        self.targets = tuple(model.config.dspark_target_layer_ids)
        self._model = model
        model.feature_layers = frozenset(self.targets)
        model.side_outputs = []

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """The last forward's features (None when nothing was captured); clears them."""
        parts, self._model.side_outputs = self._model.side_outputs, []
        if len(parts) != len(self.targets):
            return None
        sub = next((rows for rows, _ in parts if rows is not None), None)
        if sub is None:
            return None, torch.cat([f for _, f in parts], dim=-1)
        # a target below the sub-batch's first layer saw every row: keep the sub-batch's
        feats = [f if rows is not None else f.index_select(0, sub.to(f.device)) for rows, f in parts]
        return sub, torch.cat(feats, dim=-1)

    def remove(self) -> None:
        self._model.feature_layers = frozenset()
        self._model.side_outputs = []


def load_calibration(model_dir: str | Path | None, block_size: int) -> torch.Tensor | None:
    """Per-position confidence temperatures from ``dspark_calibration.json`` (None: absent, T = 1);
    a file that does not fit the drafter is a one-line ValueError."""
    if model_dir is None:
        return None
    path = Path(model_dir) / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        temps = json.loads(path.read_text())["temperatures"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a DSpark calibration file ({type(e).__name__}: {e})") from None
    if (not isinstance(temps, list) or len(temps) < block_size
            or not all(isinstance(t, (int, float)) and t > 0 for t in temps)):
        raise ValueError(f"{path}: temperatures must be {block_size} positive numbers, got {temps!r}")
    return torch.tensor(temps[:block_size], dtype=torch.float32)


class ServingDrafter:
    """V4.1's ``DraftModel`` (engine/spec/draft_model.py) over a built target model."""

    def __init__(self, model, *, model_dir: str | Path | None = None) -> None:
        self.drafter = DSparkDrafter(model)  # raises when the model has no stages
        c = model.config
        self.config = c
        self.block_size = c.dspark_block_size
        self.num_stages = len(self.drafter.stages)
        self.window = c.sliding_window
        self.row_width = c.head_dim
        self.vocab_size = c.vocab_size
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        temps = load_calibration(model_dir, self.block_size)  # on the device: a CUDA graph of the pass reads them
        self.drafter.temperatures = None if temps is None else temps.to(self.device)
        for stage in self.drafter.stages:
            stage.finalize()  # the serving modules' fused weights (the model finalizes its layers only)
        self.capture = FeatureCapture(model)
        # every stage's kv_proj as one GEMM, their kv norms applied to the stacked rows
        attn = [stage.self_attn for stage in self.drafter.stages]
        if len({a.eps for a in attn}) != 1:
            raise ValueError("DSpark stages with different kv norm eps are not supported")
        self._kv_weight = torch.cat([a.kv_proj.weight.detach() for a in attn], dim=0).contiguous()  # [S * hd, D]
        self._kv_norm = torch.stack([a.kv_norm.weight.detach().float() for a in attn])  # [S, hd]
        self._kv_eps = attn[0].eps
        last = self.drafter.stages[-1]
        conf_w = last.confidence_head.proj.weight.detach().float()  # [1, hidden + markov rank]
        hidden = c.hidden_size
        self._markov = (last.markov_head.embed.weight.detach().float(),  # [V, rank]
                        last.markov_head.head.weight.detach().float().t().contiguous(),  # [rank, V]
                        conf_w[:, :hidden].t().contiguous(), conf_w[:, hidden:].t().contiguous())

    # ---- the target's features ------------------------------------------------------------
    def take_features(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        return self.capture.take()

    @torch.inference_mode()
    def context_rows(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``features [n, targets * D]`` at ``positions [n]`` -> injected rows ``[stages, n, hd]``:
        ``DSparkDrafter.context_kv(inject(features))`` with the stages' kv projections as one GEMM
        and their norms and rope applied to the stacked rows (a step's ring write: ~12 launches
        instead of ~30)."""
        dr, c = self.drafter, self.config
        first = dr.stages[0]
        x = ops.rms_norm(ops.linear(features.to(self.dtype), first.main_proj.weight, False), first.main_norm.weight,
                         c.rms_norm_eps)  # fmt: skip
        n, hd = x.shape[0], self.row_width
        kv = ops.linear(x, self._kv_weight, False).view(n, self.num_stages, hd)
        kv = (F.rms_norm(kv.float(), (hd,), None, self._kv_eps) * self._kv_norm).to(kv.dtype)
        cos, sin = D.rope_tables(positions, dr.target.main_inv_freq)
        return D.rope(kv, cos, sin).transpose(0, 1)

    # ---- drafts -------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, y: torch.Tensor, anchors: torch.Tensor, ctx_kv: torch.Tensor, ctx_valid: torch.Tensor) -> Drafts:
        """``y [N]`` the tokens just committed at ``anchors + 1``; ``ctx_kv [stages, N, C, hd]``
        with ``ctx_valid [N, C]`` -> K greedy drafts per row and their calibrated confidences."""
        dr = self.drafter
        ids = dr.block_ids(y)
        positions = anchors[:, None] + 1 + torch.arange(self.block_size, device=anchors.device)[None, :]
        h = self.block(ids, positions, ctx_kv, ctx_valid)
        n, k, width = h.shape
        base = ops.linear(ops.rms_norm(h.reshape(-1, width), dr.stages[-1].norm.weight, self.config.rms_norm_eps),
                          dr.target.lm_head.weight, False).float().view(n, k, -1)
        # Only the Markov chain is sequential: d_{j+1} = argmax(U_j + head @ embed[d_j]); the
        # confidence proj([h_j ; embed[d_j]]) splits into an h part and an embed part, both
        # computed for the whole block once the chain is drawn.
        embed, head_t, conf_h, conf_e = self._markov
        prev, drafts = y, []
        for j in range(k):
            prev = torch.addmm(base[:, j], F.embedding(prev, embed), head_t).argmax(dim=-1)
            drafts.append(prev)
        tokens = torch.stack(drafts, dim=1)
        prevs = torch.cat([y[:, None], tokens[:, :-1]], dim=1)
        conf = (h.float() @ conf_h + F.embedding(prevs, embed) @ conf_e).squeeze(-1)
        return Drafts(tokens, conf, dr.calibrated(conf))

    def block(self, ids: torch.Tensor, positions: torch.Tensor, ctx_kv: torch.Tensor,
              ctx_valid: torch.Tensor) -> torch.Tensor:
        """``DSparkDrafter.block`` on the serving modules: pre-norm ``h [N, K, D]``."""
        c, dr = self.config, self.drafter
        n, k = ids.shape
        eps, bi = c.rms_norm_eps, False  # drafts need no batch invariance: they never change outputs
        flat_ids = ids.reshape(-1)
        streams = F.embedding(flat_ids, dr.target.embed_tokens.weight)[:, None, :].expand(-1, c.hc_mult, -1).contiguous()
        pre = streams.new_zeros(n * k, c.hc_mult, dtype=torch.float32)
        pre[:, 0] = 1.0
        cos, sin = D.rope_tables(positions, dr.target.main_inv_freq)
        allowed = torch.cat([ctx_valid[:, None, :].expand(n, k, -1),
                             torch.ones(n, k, k, dtype=torch.bool, device=ids.device)], dim=-1)
        for s, stage in enumerate(dr.stages):
            attn = stage.self_attn
            attn_pre, post, comb = stage.attn_hc.weights(streams, bi)
            x = ops.rms_norm(HyperConnection.collapse(streams, pre, bi), stage.input_layernorm.weight, eps)
            q, kv, _ = D.attention_inputs(attn, x.view(n, k, -1), cos, sin)
            out = D.sink_attention(q, torch.cat([ctx_kv[s].to(kv.dtype), kv], dim=1), allowed, attn.sinks,
                                   attn.head_dim**-0.5)
            out = D.attention_output(attn, out, cos, sin).reshape(n * k, -1)
            streams = HyperConnection.post(out, streams, post, comb, bi)
            ffn_pre, post, comb = stage.ffn_hc.weights(streams, bi)
            x = ops.rms_norm(HyperConnection.collapse(streams, attn_pre, bi), stage.post_attention_layernorm.weight, eps)
            out = stage.mlp.forward(x, flat_ids, n * k, bi)
            streams = HyperConnection.post(out, streams, post, comb, bi)
            pre = ffn_pre
        return HyperConnection.collapse(streams, pre, bi).view(n, k, -1)
