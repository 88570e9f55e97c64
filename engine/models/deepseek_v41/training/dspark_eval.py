"""DSpark on held-out text: greedy acceptance of the drafter against the target, and confidence calibration.

For ``num`` held-out prompts of ``prompt_len`` tokens the target continues greedily for ``new``
tokens; the sequence is then the target's own greedy output, so its tokens are what greedy
verification accepts. For every anchor p in the continuation (y = the token at p + 1 the target
produced, context up to p) the drafter drafts K tokens greedily (dspark.py); draft k is accepted
when it and every earlier draft equal the target's tokens at p + 2 .. p + 1 + k.

    chain        decoding as the engine would: start at the first generated token, accept the
                 matching prefix, commit it plus the target's bonus token, move on; tokens per
                 verification step = accepted drafts + 1
    per position the fraction of chain steps accepting at least k drafts, and the conditional
                 acceptance rate of draft k given drafts 1..k-1 were accepted (all anchors)
    confidence   per position, the events (confidence logit, accepted) of drafts whose earlier
                 drafts were accepted; temperatures are fitted on the calibration split and the
                 ECE reported on the test split, raw and calibrated, per position and for the
                 prefix survival (product of the confidences up to k vs "at least k accepted")
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.engine.models.deepseek_v41.dense_forward import dense_forward
from deepinfer.engine.models.deepseek_v41.dspark import DSparkDrafter, context_windows
from deepinfer.engine.models.deepseek_v41.training.calibration import ece, fit_temperatures, sigmoid
from deepinfer.engine.models.deepseek_v41.training.evaluate import greedy

ANCHOR_CHUNK = 1024


def prompts_from(stream: np.ndarray, num: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - prompt_len, size=num)
    return [stream[s : s + prompt_len].astype(np.int64).tolist() for s in starts]


@torch.no_grad()
def draft_outcomes(model, drafter: DSparkDrafter, prompts: list[list[int]], new: int, generate=None) -> dict:
    """Per anchor: accepted drafts, per-slot matches and confidence logits (see module docstring)."""
    device = model.embed_tokens.weight.device
    k = drafter.block_size
    gen = generate(prompts, new, ()) if generate is not None else greedy(model, prompts, new)
    gen = [g[:new] for g in gen]
    seq = torch.tensor([p + g for p, g in zip(prompts, gen)], device=device)
    b, t = seq.shape
    p0 = len(prompts[0]) - 1  # anchor of the first generated token (at p0 + 1)
    anchors = torch.arange(p0, t - k - 1, device=device)  # drafts up to position t - 1
    out = dense_forward(model, seq, features=True)
    main_x = drafter.inject(out.features)
    ctx = drafter.context_kv(main_x, torch.arange(t, device=device)[None].expand(b, -1))
    rows = [(i, a) for i in range(b) for a in anchors.tolist()]
    matches, conf_logits = [], []
    for lo in range(0, len(rows), ANCHOR_CHUNK):
        chunk = torch.tensor(rows[lo : lo + ANCHOR_CHUNK], device=device)
        seq_i, p = chunk[:, 0], chunk[:, 1]
        window, valid = context_windows(t, p, drafter.config.sliding_window)
        slots = p[:, None] + 1 + torch.arange(k, device=device)[None]
        y = seq[seq_i, p + 1]
        h = drafter.block(drafter.block_ids(y), slots, ctx[:, seq_i[:, None], window], valid)
        drafted = drafter.draft(h, y)
        matches.append((drafted.tokens == seq[seq_i[:, None], slots + 1]).cpu())
        conf_logits.append(drafted.logits.cpu())
    match = torch.cat(matches).view(b, len(anchors), k).numpy()
    logit = torch.cat(conf_logits).view(b, len(anchors), k).numpy()
    accepted = np.cumprod(match, axis=-1).sum(-1)  # [b, anchors]
    return {"match": match, "logits": logit, "accepted": accepted}


def chain_steps(accepted: np.ndarray) -> list[int]:
    """Accepted drafts of each verification step of greedy decoding through the anchors."""
    steps = []
    for row in accepted:
        i = 0
        while i < len(row):
            steps.append(int(row[i]))
            i += int(row[i]) + 1
    return steps


def position_events(match: np.ndarray, logits: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per draft position k: (logits, accepted) of the anchors whose drafts 1..k-1 were accepted."""
    k = match.shape[-1]
    m, lg = match.reshape(-1, k), logits.reshape(-1, k)
    alive = np.ones(len(m), dtype=bool)
    events = []
    for j in range(k):
        events.append((lg[alive, j], m[alive, j].astype(np.float64)))
        alive &= m[:, j].astype(bool)
    return events


def dspark_report(model, drafter: DSparkDrafter, streams: dict[str, np.ndarray], *, num: int, prompt_len: int,
                  new: int, seed: int, generate=None) -> dict:
    cal = draft_outcomes(model, drafter, prompts_from(streams["calibration"], num, prompt_len, seed), new, generate)
    test = draft_outcomes(model, drafter, prompts_from(streams["test"], num, prompt_len, seed + 1), new, generate)
    temps = fit_temperatures(position_events(cal["match"], cal["logits"]))
    k = len(temps)
    steps = np.array(chain_steps(test["accepted"]))
    events = position_events(test["match"], test["logits"])
    raw = [ece(sigmoid(lg), out) for lg, out in events]
    calibrated = [ece(sigmoid(lg / tk), out) for (lg, out), tk in zip(events, temps)]
    flat_logits = test["logits"].reshape(-1, k)
    flat_accept = test["accepted"].reshape(-1)
    survival = {}
    for name, scale in (("raw", np.ones(k)), ("calibrated", np.array(temps))):
        cum = np.cumprod(sigmoid(flat_logits / scale), axis=-1)
        survival[name] = [ece(cum[:, j], (flat_accept > j).astype(np.float64)) for j in range(k)]
    return {
        "prompts": num, "prompt_len": prompt_len, "new_tokens": new, "block_size": k,
        "steps": int(len(steps)),
        "calibration_tokens_per_step": float(np.mean(chain_steps(cal["accepted"])) + 1),
        "accepted_drafts_per_step": float(steps.mean()),
        "tokens_per_step": float(steps.mean() + 1),
        "at_least_k_accepted": [float((steps >= j).mean()) for j in range(1, k + 1)],
        "conditional_acceptance": [float(out.mean()) if len(out) else float("nan") for _, out in events],
        "events_per_position": [int(len(out)) for _, out in events],
        "temperatures": temps,
        "ece_raw": raw, "ece_calibrated": calibrated,
        "survival_ece_raw": survival["raw"], "survival_ece_calibrated": survival["calibrated"],
        "mean_confidence_calibrated": [float(sigmoid(lg / tk).mean()) if len(lg) else float("nan")
                                       for (lg, _), tk in zip(events, temps)],
    }
