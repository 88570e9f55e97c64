"""Phase 2 of `deepinfer train-tiny`: the DSpark drafter alone, distilled on the target's own greedy text.

The joint phase (trainer.py) teaches the drafter the target's distribution on corpus text while
the target itself still moves. Greedy verification accepts a draft when it equals the *frozen*
target's argmax on the target's *own* continuations, so this phase trains on exactly that:

    data     ``sequences`` training-split prompts of ``prompt_len`` tokens, each continued greedily
             by the target for ``new`` tokens (``generate``: the cache-free forward by default, or
             the serving engine, which is the same model and much faster on a CPU); the target's
             features and argmax at every position are computed once (no grad)
    step     ``seqs_per_step`` sequences x ``anchors`` draft blocks (a share ``greedy_fraction``
             anchored inside the continuation), cross-entropy of the drafts to the target's argmax
             (slot decay as in phase 1) + the confidence head's BCE; AdamW on the drafter's
             tensors only (DSpark stages, Markov and confidence heads), cosine schedule, QAT on the
             drafter's FP8/FP4 tensors throughout

The target's weights are not touched (it stays at its checkpoint values).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.utils import parametrize

from deepinfer.engine.models.deepseek_v41.dense_forward import dense_forward, logits
from deepinfer.engine.models.deepseek_v41.dspark import DSparkDrafter
from deepinfer.engine.models.deepseek_v41.training.dspark_eval import prompts_from
from deepinfer.engine.models.deepseek_v41.training.evaluate import greedy
from deepinfer.engine.models.deepseek_v41.training.model_setup import enable_qat
from deepinfer.engine.models.deepseek_v41.training.trainer import draft_losses

Generate = Callable[[list[list[int]], int], list[list[int]]]


@dataclass(frozen=True, slots=True)
class DrafterOptions:
    seed: int = 0
    sequences: int = 1536
    prompt_len: int = 128
    new: int = 128
    steps: int = 700
    seqs_per_step: int = 8
    anchors: int = 64
    greedy_fraction: float = 0.5
    lr: float = 5e-4
    warmup: int = 30
    slot_decay: float = 0.8
    confidence_weight: float = 0.2
    feature_batch: int = 16
    log_every: int = 50
    max_seconds: float | None = None  # stop the steps early (recorded) past this wall time


@dataclass(slots=True)
class GreedyData:
    ids: torch.Tensor  # [N, L] prompt + greedy continuation
    features: torch.Tensor  # [N, L, S * D] the target's DSpark features
    argmax: torch.Tensor  # [N, L] the target's argmax at every position
    prompt_len: int


@torch.no_grad()
def greedy_data(model, stream: np.ndarray, o: DrafterOptions, generate: Generate | None = None) -> GreedyData:
    prompts = prompts_from(stream, o.sequences, o.prompt_len, o.seed + 11)
    new = generate(prompts, o.new) if generate is not None else greedy(model, prompts, o.new)
    device = model.embed_tokens.weight.device
    ids = torch.tensor([p + g[: o.new] for p, g in zip(prompts, new)])
    feats, argmax = [], []
    for lo in range(0, len(ids), o.feature_batch):
        out = dense_forward(model, ids[lo : lo + o.feature_batch].to(device), features=True)
        feats.append(out.features.cpu())
        argmax.append(logits(model, out.hidden).argmax(-1).cpu())
    return GreedyData(ids, torch.cat(feats), torch.cat(argmax), o.prompt_len)


def drafter_tensors(model) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if n.startswith("mtp.")]


def finetune_drafter(model, data: GreedyData, o: DrafterOptions, log=print) -> list[dict]:
    device = model.embed_tokens.weight.device
    for p in model.parameters():
        p.requires_grad_(False)
    enable_qat(model, prefix="mtp.")
    params = drafter_tensors(model)
    for p in params:
        p.requires_grad_(True)
    drafter = DSparkDrafter(model)
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(o.seed + 13)
    n, length = data.ids.shape
    k = drafter.block_size
    history, start = [], time.perf_counter()
    for step in range(o.steps):
        lr = o.lr * min(1.0, (step + 1) / o.warmup) * 0.5 * (1 + math.cos(math.pi * step / o.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        rows = rng.choice(n, size=o.seqs_per_step, replace=False)
        lo = np.where(rng.random((o.seqs_per_step, o.anchors)) < o.greedy_fraction, data.prompt_len - 1, 0)
        anchors = torch.from_numpy(rng.integers(lo, length - k - 1)).to(device)
        idx = torch.from_numpy(rows)
        with parametrize.cached():
            draft, confidence, top1 = draft_losses(drafter, data.ids[idx].to(device), data.features[idx].to(device),
                                                   data.argmax[idx].to(device), anchors, o.slot_decay)
            loss = draft + o.confidence_weight * confidence
            opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        over = o.max_seconds is not None and time.perf_counter() - start > o.max_seconds
        if (step + 1) % o.log_every == 0 or step == o.steps - 1 or over:
            record = {"step": step + 1, "draft": float(draft.detach()), "confidence": float(confidence.detach()),
                      "draft_top1": float(top1), "lr": lr, "elapsed_s": time.perf_counter() - start}
            history.append(record)
            log(" ".join(f"{key} {v:.4g}" if isinstance(v, float) else f"{key} {v}" for key, v in record.items()))
        if over:
            log(f"drafter phase: stopping after step {step + 1}: past max_seconds {o.max_seconds}")
            break
    for p in params:
        p.requires_grad_(False)
    return history
