"""`deepinfer train-tiny` end to end: train on a prepared data directory, save, reload, evaluate.

    OUT/
      config.json, model.safetensors          the official V4.1 layout (FP8/FP4 storage)
      tokenizer.json, tokenizer_config.json   the BPE tokenizer with the chat template
      dspark_calibration.json                 the confidence head's per-position temperatures
      eval.json                               every figure of the README section
      routing_trace.npy                       [steps, layers, experts] token counts on held-out text

With ``RunOptions.drafter`` set, phase 2 (drafter_phase.py: the drafter distilled on the target's
own greedy text) runs on the saved checkpoint before the one evaluation.

Evaluation runs on the checkpoint read back from disk (the weights serving loads), with the
cache-free forward; the in-memory float weights give the pre-quantisation loss for comparison.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from deepinfer.engine.core.model_runner import load_weights
from deepinfer.engine.models.deepseek_v41 import checkpoint_names as names
from deepinfer.engine.models.deepseek_v41.checkpoint_writer import save_v41_checkpoint
from deepinfer.engine.models.deepseek_v41.dspark import CALIBRATION_FILE, DSparkDrafter
from deepinfer.engine.models.deepseek_v41.engram import compressed_token_map
from deepinfer.engine.models.deepseek_v41.loader import load_v41_checkpoint
from deepinfer.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.engine.models.deepseek_v41.tiny_model import vision_tensors
from deepinfer.engine.models.deepseek_v41.training import evaluate as ev
from deepinfer.engine.models.deepseek_v41.training.drafter_phase import DrafterOptions, finetune_drafter, greedy_data
from deepinfer.engine.models.deepseek_v41.training.dspark_eval import (
    chain_steps,
    draft_outcomes,
    dspark_report,
    prompts_from,
)
from deepinfer.engine.models.deepseek_v41.training.model_setup import (
    TRAIN_SIZES,
    build_model,
    disable_qat,
    quantised_tensors,
    training_config,
)
from deepinfer.engine.models.deepseek_v41.training.prepare import load_manifest
from deepinfer.engine.models.deepseek_v41.training.trainer import TrainOptions, train
from deepinfer.engine.text.markup import BOS, EOS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EVAL_FILE, TRACE_FILE = "eval.json", "routing_trace.npy"


@dataclass(frozen=True, slots=True)
class RunOptions:
    train: TrainOptions = TrainOptions()
    sizes: dict = field(default_factory=lambda: dict(TRAIN_SIZES))
    device: str = "cuda"
    eval_batch: int = 16
    dspark_prompts: int = 64
    dspark_prompt_len: int = 128
    dspark_new: int = 96
    headers: int = 64
    header_tokens: int = 192
    sample_tokens: int = 96
    trace_steps: int = 600
    eval_tokens: int | None = None  # score only the first tokens of the test stream (small runs)
    drafter: DrafterOptions | None = None  # phase 2 right after training (before the evaluation)


def load_streams(data_dir: Path) -> dict[str, np.ndarray]:
    return {s: np.load(data_dir / f"{s}.npy") for s in ("train", "calibration", "test")}


def run(data_dir: str | Path, out_dir: str | Path, o: RunOptions, log=print) -> dict:
    data, out = Path(data_dir), Path(out_dir)
    manifest = load_manifest(data)
    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    streams = load_streams(data)
    _, compressed = compressed_token_map(tokenizer, o.sizes["vocab_size"])
    cfg = training_config(compressed, o.sizes)
    torch.manual_seed(o.train.seed)
    model = build_model(cfg, data, o.train.seed, o.device)
    counts = parameter_counts(model)
    log(f"model: {counts['total']:,} parameters ({counts['routed_experts']:,} in routed experts, "
        f"{counts['active']:,} active per token); training on {o.device}")
    start = time.perf_counter()
    result = train(model, streams["train"], o.train, log)
    history = result.history
    train_s = time.perf_counter() - start
    disable_qat(model)
    float_lm = ev.heldout_lm(model, streams["test"][: o.eval_tokens], o.train.seq_len, o.eval_batch)
    save_checkpoint(model, cfg, data, out, o.train.seed)
    log(f"trained {result.steps_run} steps in {train_s:.0f} s; checkpoint "
        f"{(out / 'model.safetensors').stat().st_size / 1e6:.2f} MB in {out}")
    del model
    report = {"train": {"seconds": train_s, "steps": result.steps_run,
                        "options": asdict(o.train), "history": [asdict(h) for h in history]},
              "model": {**counts, "sizes": o.sizes, "checkpoint_bytes": (out / "model.safetensors").stat().st_size},
              "heldout_float": {k: float_lm[k] for k in ("nll", "ppl")}}
    write_json(out / EVAL_FILE, report)  # the training record survives a failing evaluation
    if o.drafter is not None:
        report["drafter_phase"] = distil_drafter(out, data, streams, o, o.drafter, log)
        write_json(out / EVAL_FILE, report)
    report.update(evaluate(out, data, streams, manifest, o, log))
    write_json(out / EVAL_FILE, report)
    return report


def distil_drafter(model_dir: Path, data: Path, streams, o: RunOptions, d: DrafterOptions, log=print,
                   generate=None) -> dict:
    """Phase 2 on the checkpoint in ``model_dir``, saved back in place (the target's stored values
    unchanged); the record holds DSpark tokens per verification step on the evaluation's held-out
    prompts before and after, so the phase's effect is measured on the same text."""
    model = load_for_eval(model_dir, o.device)
    start = time.perf_counter()
    before = _tokens_per_step(model, streams, o, generate)
    gen = None if generate is None else (lambda prompts, new: generate(prompts, new, ()))
    greedy_set = greedy_data(model, streams["train"], d, gen)
    greedy_s = time.perf_counter() - start
    log(f"drafter phase: DSpark {before:.3f} tokens per step before; {len(greedy_set.ids)} greedy sequences of "
        f"{greedy_set.ids.shape[1]} tokens in {greedy_s:.0f} s")
    history = finetune_drafter(model, greedy_set, d, log)
    after = _tokens_per_step(model, streams, o, generate)
    log(f"drafter phase: DSpark {after:.3f} tokens per step after")
    disable_qat(model)
    save_checkpoint(model, model.config, data, model_dir, o.train.seed)
    seconds = time.perf_counter() - start
    del model
    return {"seconds": seconds, "greedy_data_s": greedy_s, "device": o.device, "options": asdict(d),
            "tokens_per_step_before": before, "tokens_per_step_after": after, "history": history}


def _tokens_per_step(model, streams, o: RunOptions, generate=None) -> float:
    """Committed tokens per verification step (accepted drafts + 1) on the evaluation's test prompts."""
    prompts = prompts_from(streams["test"], o.dspark_prompts, o.dspark_prompt_len, o.train.seed + 1)
    outcome = draft_outcomes(model, DSparkDrafter(model), prompts, o.dspark_new, generate)
    return float(np.mean(chain_steps(outcome["accepted"])) + 1)


def drafter_phase(model_dir: str | Path, data_dir: str | Path, o: RunOptions, d: DrafterOptions, log=print,
                  generate=None) -> dict:
    """Phase 2 alone on a trained checkpoint, then the evaluation again; eval.json keeps phase 1's record."""
    model_dir, data = Path(model_dir), Path(data_dir)
    streams = load_streams(data)
    record = distil_drafter(model_dir, data, streams, o, d, log, generate)
    previous = json.loads((model_dir / EVAL_FILE).read_text(encoding="utf-8")) if (model_dir / EVAL_FILE).is_file() else {}
    report = {k: previous[k] for k in ("train", "model", "heldout_float") if k in previous}
    report["drafter_phase"] = record
    report.update(evaluate(model_dir, data, streams, load_manifest(data), o, log, generate))
    write_json(model_dir / EVAL_FILE, report)
    return report


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(_finite(value), indent=1) + "\n", encoding="utf-8")


def _finite(value):
    """NaN (a position no draft reached) as null: strict JSON."""
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def parameter_counts(model) -> dict[str, int]:
    c = model.config
    total = routed = 0
    for name, t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
        if not t.is_floating_point() or name.endswith("embed_scale"):
            continue
        total += t.numel()
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            routed += t.numel()
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    backbone_routed = c.num_hidden_layers * c.n_routed_experts * per_expert
    active = total - routed + c.num_hidden_layers * c.num_experts_per_tok * per_expert
    return {"total": total, "routed_experts": routed, "backbone_routed_experts": backbone_routed, "active": active}


def save_checkpoint(model, cfg, data_dir: Path, out: Path, seed: int) -> None:
    quantised = _quantised_names(model)
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().float().cpu()
        # quantised tensors go to the writer in float32 (the QAT forward saw exactly their FP8/FP4
        # image); the others are stored in bfloat16 unless they stay float32
        tensors[name] = t if name in quantised or names.keeps_fp32(name) else t.to(torch.bfloat16)
    save_v41_checkpoint(out, cfg, tensors, quantize=True, extra=vision_tensors(cfg, seed))
    for f in TOKENIZER_FILES:
        shutil.copyfile(data_dir / f, out / f)


def _quantised_names(model) -> set[str]:
    found = set()
    prefix_of = {id(m): p for p, m in model.named_modules()}
    for module, attr, _ in quantised_tensors(model):
        p = prefix_of[id(module)]
        found.add(f"{p}.{attr}" if p else attr)
    return found


def load_for_eval(model_dir: Path, device: str) -> DeepseekV41ForCausalLM:
    """The checkpoint as serving reads it (dequantised exactly), Engram tables as float32 rows
    (their scales folded in, so the model can be trained and saved again)."""
    loaded = load_v41_checkpoint(model_dir, dtype=torch.float32)
    model = DeepseekV41ForCausalLM(dataclasses.replace(loaded.config, quantization=None))
    load_weights(model, loaded.tensors)
    with torch.no_grad():
        for layer in model.layers:
            if layer.engram is not None:
                e = layer.engram
                e.embed.copy_((e.embed.view(e.embed.shape[0], -1, 32) * e.embed_scale[:, :, None]).view(e.embed.shape))
                e.embed_scale.fill_(1.0)
    return model.to(device).eval()


def evaluate(model_dir: Path, data_dir: Path, streams, manifest: dict, o: RunOptions, log=print,
             generate=None) -> dict:
    """Every figure of eval.json for the checkpoint in ``model_dir``. ``generate(prompts, max_new,
    stop_ids)`` produces the greedy continuations (default: the cache-free forward; the serving
    engine gives the same tokens, faster on a CPU)."""
    start = time.perf_counter()
    model = load_for_eval(model_dir, o.device)
    if generate is None:
        def generate(prompts, max_new, stop_ids=()):
            return ev.greedy(model, prompts, max_new, stop_ids)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stop = (tokenizer.token_to_id(EOS), tokenizer.token_to_id(BOS))
    lm = ev.heldout_lm(model, streams["test"][: o.eval_tokens], o.train.seq_len, o.eval_batch)
    np.save(model_dir / TRACE_FILE, lm.pop("trace")[: o.trace_steps].astype(np.float32))
    ngram = manifest["ngram"]
    log(f"held-out NLL {lm['nll']:.4f} (ppl {lm['ppl']:.2f}) vs {ngram['order']}-gram {ngram['test_nll']:.4f} "
        f"(ppl {ngram['test_ppl']:.2f}); expert max/mean per layer " + " ".join(f"{v:.2f}" for v in lm["max_over_mean"]))
    headers = json.loads((data_dir / "headers.json").read_text(encoding="utf-8"))[: o.headers]
    parsed = ev.parse_rate(generate, tokenizer, headers, o.header_tokens, stop)
    log(f"held-out function headers: {parsed['rate']:.0%} of {parsed['num']} completions parse")
    samples = ev.samples(generate, tokenizer, o.sample_tokens, stop)
    drafter = DSparkDrafter(model)
    spark = dspark_report(model, drafter, streams, num=o.dspark_prompts, prompt_len=o.dspark_prompt_len,
                          new=o.dspark_new, seed=o.train.seed, generate=generate)
    log(f"DSpark: {spark['tokens_per_step']:.2f} tokens per verification step ({spark['accepted_drafts_per_step']:.2f} "
        f"drafts accepted); ECE raw " + " ".join(f"{v:.3f}" for v in spark["ece_raw"]) + " calibrated " +
        " ".join(f"{v:.3f}" for v in spark["ece_calibrated"]))
    calibration = {"block_size": spark["block_size"], "temperatures": spark["temperatures"],
                   "fitted_on": "calibration split: log loss of greedy drafts whose earlier drafts were accepted",
                   "test_ece_raw": spark["ece_raw"], "test_ece_calibrated": spark["ece_calibrated"]}
    write_json(model_dir / CALIBRATION_FILE, calibration)
    return {"data": manifest, "heldout": lm, "ngram": ngram,
            "heldout_vs_ngram": {"nll_gap": lm["nll"] - ngram["test_nll"],
                                 "ppl_ratio": math.exp(lm["nll"] - ngram["test_nll"])},
            "parse": parsed, "samples": samples, "dspark": spark, "eval_seconds": time.perf_counter() - start}
