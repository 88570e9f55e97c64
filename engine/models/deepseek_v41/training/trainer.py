"""The training loop of `deepinfer train-tiny`: target, indexers and DSpark drafter in one step.

Per step, ``batch`` random windows of ``seq_len + 1`` tokens from the training stream (numpy
generator from the seed):

    lm          next-token cross-entropy of the cache-free forward (dense_forward.py)
    index       the indexers' distillation loss (their hard top-k passes no gradient)
    draft       ``anchors`` random draft blocks per sequence: the drafter (dspark.py) reads the
                target's features (detached) up to the anchor p, drafts positions p+2 .. p+K+1
                with the Markov head fed the true previous token, and is trained towards the
                target's own next-token distribution there (soft cross-entropy, slot k weighted
                ``slot_decay ** k``)
    confidence  BCE of the confidence head (on detached inputs) against "the draft's argmax is
                the target's argmax" at that slot

Router biases are not learned by gradient: as in DeepSeek's auxiliary-loss-free balancing they
move by ``bias_rate`` per step towards a target load, here a Zipf law (exponent ``skew``) over a
per-layer random order of the experts, so the trained model routes with a realistic, stable skew
(EPLB gets a trace to balance). DSpark stages route freely.

AdamW (decay on matrices and tables), linear warm-up then cosine to ``min_lr_ratio``, gradient
clipping; QAT from ``qat_from`` of the steps on (model_setup.py). Float32 weights and
activations, TF32 matmuls on GPUs.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from deepinfer.engine.models.deepseek_v41.dense_forward import dense_forward, logits
from deepinfer.engine.models.deepseek_v41.dspark import DSparkDrafter, context_windows
from deepinfer.engine.models.deepseek_v41.training.model_setup import enable_qat, trainable


@dataclass(frozen=True, slots=True)
class TrainOptions:
    seed: int = 0
    steps: int = 620  # ~5 minutes on one H200 at ~95k tokens/s
    batch: int = 96
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    anchors: int = 32  # draft blocks per sequence and step
    draft_weight: float = 1.0
    slot_decay: float = 0.8
    confidence_weight: float = 0.2
    index_weight: float = 0.1
    qat_from: float = 0.7  # fraction of the steps after which QAT is on
    bias_rate: float = 3e-3
    skew: float = 0.7
    log_every: int = 50
    max_seconds: float | None = None  # stop early (recorded) past this wall time
    stop_after: int | None = None  # run only this many steps of the ``steps`` schedule (a replay of a stopped run)


@dataclass(slots=True)
class TrainResult:
    history: list  # StepStats every log_every steps
    steps_run: int


@dataclass(slots=True)
class StepStats:
    step: int
    lm: float
    index: float
    draft: float
    confidence: float
    draft_top1: float
    lr: float
    tokens_per_s: float
    elapsed_s: float


def zipf_targets(num_layers: int, num_experts: int, top_k: int, skew: float, seed: int) -> torch.Tensor:
    """``[layers, E]`` target assignments per token (each row sums to top_k; every value <= 1)."""
    g = torch.Generator().manual_seed(seed + 7)
    ranks = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -skew
    rows = []
    for _ in range(num_layers):
        w = ranks / ranks.sum() * top_k
        if float(w.max()) > 1:
            raise ValueError(f"skew {skew} asks one expert for more than every token; lower it")
        rows.append(w[torch.randperm(num_experts, generator=g)])
    return torch.stack(rows).float()


def lr_at(step: int, o: TrainOptions) -> float:
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    progress = (step - o.warmup) / max(1, o.steps - o.warmup)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _optimizer(model, o: TrainOptions, device) -> torch.optim.Optimizer:
    decay, plain = [], []
    for name, t in trainable(model).items():
        (decay if t.dim() >= 2 and not name.endswith((".fn",)) else plain).append(t)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=o.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def train(model, stream: np.ndarray, o: TrainOptions, log=print) -> TrainResult:
    device = model.embed_tokens.weight.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model.train()
    drafter = DSparkDrafter(model)
    opt = _optimizer(model, o, device)
    rng = np.random.default_rng(o.seed)
    c = model.config
    targets = zipf_targets(c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok, o.skew, o.seed).to(device)
    biases = [layer.mlp.gate.e_score_correction_bias for layer in model.layers]
    tokens = torch.from_numpy(stream.astype(np.int64))
    history: list[StepStats] = []
    qat_step = int(o.qat_from * o.steps)
    start = last = time.perf_counter()
    last_step = 0
    steps_run = 0
    for step in range(o.steps if o.stop_after is None else min(o.steps, o.stop_after)):
        if step == qat_step:
            # the optimizer keeps the same tensors: a parametrization holds the original object
            log(f"step {step}: quantisation-aware training on ({enable_qat(model)} tensors)")
        lr = lr_at(step, o)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(tokens) - o.seq_len - 1, size=o.batch)
        batch = torch.stack([tokens[s : s + o.seq_len + 1] for s in starts.tolist()]).to(device, non_blocking=True)
        anchors = rng.integers(0, o.seq_len - c.dspark_block_size, size=(o.batch, o.anchors))
        with parametrize.cached():
            losses, expert_ids = step_losses(model, drafter, batch, torch.from_numpy(anchors).to(device), o)
            total = losses["lm"] + o.index_weight * losses["index"] + o.draft_weight * losses["draft"] + \
                o.confidence_weight * losses["confidence"]
            opt.zero_grad(set_to_none=True)
            total.backward()
        torch.nn.utils.clip_grad_norm_([t for g in opt.param_groups for t in g["params"]], o.grad_clip)
        opt.step()
        _steer_biases(biases, expert_ids, targets, o.bias_rate)
        steps_run = step + 1
        if (step + 1) % o.log_every == 0 or step == o.steps - 1:
            now = time.perf_counter()
            rate = (step + 1 - last_step) * o.batch * o.seq_len / (now - last)
            s = StepStats(step + 1, *(float(losses[k].detach()) for k in ("lm", "index", "draft", "confidence", "draft_top1")),
                          lr, rate, now - start)
            history.append(s)
            last, last_step = now, step + 1
            log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in asdict(s).items()))
        if o.max_seconds is not None and time.perf_counter() - start > o.max_seconds:
            log(f"stopping after step {step + 1}: past max_seconds {o.max_seconds}")
            break
    model.eval()
    return TrainResult(history, steps_run)


def step_losses(model, drafter: DSparkDrafter, batch: torch.Tensor, anchors: torch.Tensor, o: TrainOptions):
    """Losses of one batch ``[B, T + 1]`` with draft anchors ``[B, A]`` (each < T - K)."""
    ids, labels = batch[:, :-1], batch[:, 1:]
    out = dense_forward(model, ids, features=True, index_kl=o.index_weight > 0)
    lg = logits(model, out.hidden)
    lm = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels.reshape(-1))
    draft, confidence, top1 = draft_losses(drafter, ids, out.features.detach(), lg.detach(), anchors, o.slot_decay)
    index = out.index_kl if out.index_kl is not None else lm.new_zeros(())
    return {"lm": lm, "index": index, "draft": draft, "confidence": confidence, "draft_top1": top1}, out.expert_ids


def draft_losses(drafter: DSparkDrafter, ids: torch.Tensor, features: torch.Tensor, teacher: torch.Tensor,
                 anchors: torch.Tensor, slot_decay: float):
    """(draft loss, confidence BCE, fraction of slots whose argmax matches the teacher's).

    ``teacher`` is the target's prediction at every position: logits ``[B, T, V]`` (soft
    cross-entropy to its distribution) or token ids ``[B, T]`` (its argmax: cross-entropy)."""
    b, t = ids.shape
    k = drafter.block_size
    main_x = drafter.inject(features)
    positions = torch.arange(t, device=ids.device)
    ctx = drafter.context_kv(main_x, positions[None].expand(b, -1))  # [S, B, T, hd]
    seq = torch.arange(b, device=ids.device)[:, None].expand_as(anchors).reshape(-1)
    p = anchors.reshape(-1)
    window, valid = context_windows(t, p, drafter.config.sliding_window)
    ctx_kv = ctx[:, seq[:, None], window]  # [S, N, W, hd]
    slots = p[:, None] + 1 + torch.arange(k, device=ids.device)[None]  # positions p+1 .. p+K
    prev = ids[seq[:, None], slots]  # slot k's previous token: y, then the true tokens
    h = drafter.block(drafter.block_ids(prev[:, 0]), slots, ctx_kv, valid)
    scores = drafter.base_logits(h) + drafter.markov_bias(prev)
    wanted = teacher[seq[:, None], slots]  # the target's prediction of position slot + 1
    if wanted.dim() == 3:
        per_slot = -(torch.softmax(wanted, dim=-1) * torch.log_softmax(scores, dim=-1)).sum(-1)  # [N, K]
        wanted = wanted.argmax(-1)
    else:
        per_slot = F.cross_entropy(scores.transpose(1, 2), wanted, reduction="none")
    weights = slot_decay ** torch.arange(k, device=ids.device, dtype=torch.float32)
    draft = (per_slot * weights).sum(-1).mean() / weights.sum()
    hit = (scores.argmax(-1) == wanted).float()
    conf = drafter.confidence_logits(h.detach(), prev)
    confidence = F.binary_cross_entropy_with_logits(conf, hit)
    return draft, confidence, hit.mean().detach()


@torch.no_grad()
def _steer_biases(biases, expert_ids, targets: torch.Tensor, rate: float) -> None:
    """bias += rate * sign(target load - load) per expert (loads counted over this step's tokens)."""
    for bias, ids, target in zip(biases, expert_ids, targets):
        counts = torch.bincount(ids.reshape(-1), minlength=bias.numel()).float()
        bias += rate * torch.sign(target * ids.shape[0] - counts)
