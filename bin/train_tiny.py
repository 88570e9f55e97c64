"""`deepinfer train-tiny`: train the built-in tiny DeepSeek-V4.1 model and its DSpark drafter.

Two phases (engine/models/deepseek_v41/training/): ``prepare`` (CPU: this interpreter's standard
library -> BPE tokenizer -> token streams, held-out files, n-gram baseline) into ``--data``, then
train + save + evaluate into OUT. An existing prepared ``--data`` directory is reused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from deepinfer.bin.cli import CliError


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name, help="train the tiny V4.1 model on the Python standard library",
        description="Train a tiny DeepSeek-V4.1 model (every structural feature on) with its DSpark drafter, "
                    "Markov and confidence heads on this interpreter's standard library, offline; write the "
                    "checkpoint (official layout), tokenizer, calibration, eval.json and a routing trace to OUT.",
    )
    p.add_argument("out", help="output checkpoint directory")
    p.add_argument("--data", default=None, help="prepared data directory (default: OUT-data); prepared when missing")
    p.add_argument("--prepare-only", action="store_true", help="only prepare --data (CPU) and stop")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, data order, init and anchors (default 0)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the trainer's)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per training sequence")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default: cuda when available)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop training early past this wall time")
    p.add_argument("--stop-after", type=int, default=None,
                   help="run only this many steps of the --steps schedule (replays a run the wall-time guard stopped)")
    p.add_argument("--small", action="store_true",
                   help="a few-second model on a 40-file corpus (the CPU path the tests run)")
    p.add_argument("--drafter-phase", action="store_true",
                   help="phase 2 only, on the checkpoint in OUT: distil the DSpark drafter on the target's greedy "
                        "text, save OUT again (the target unchanged) and re-evaluate")
    p.add_argument("--with-drafter-phase", action="store_true",
                   help="run phase 2 right after training, before the one evaluation")
    p.add_argument("--drafter-steps", type=int, default=None, help="phase 2 steps")
    p.add_argument("--drafter-sequences", type=int, default=None, help="phase 2 greedy sequences")
    p.add_argument("--drafter-prompt-len", type=int, default=None, help="phase 2 prompt tokens per sequence")
    p.add_argument("--drafter-new", type=int, default=None, help="phase 2 greedy tokens per sequence")
    p.add_argument("--drafter-minutes", type=float, default=None, help="stop phase 2's steps past this wall time")
    p.add_argument("--eval-only", action="store_true", help="only evaluate the checkpoint in OUT again")
    p.add_argument("--engine-generate", action="store_true",
                   help="greedy continuations from the serving engine (the same tokens; much faster on a CPU)")
    return p


def run(args) -> int:
    import torch

    from deepinfer.engine.models.deepseek_v41.training.model_setup import SMALL_SIZES, TRAIN_SIZES
    from deepinfer.engine.models.deepseek_v41.training.prepare import MANIFEST, PrepareOptions, prepare
    from deepinfer.engine.models.deepseek_v41.training.run import RunOptions, run as train_run
    from deepinfer.engine.models.deepseek_v41.training.trainer import TrainOptions

    out = Path(args.out)
    data = Path(args.data) if args.data else out.with_name(out.name + "-data")
    sizes = SMALL_SIZES if args.small else TRAIN_SIZES
    if not (data / MANIFEST).is_file():
        try:
            prepare(data, PrepareOptions(seed=args.seed, vocab_size=sizes["vocab_size"],
                                         max_files=40 if args.small else None,
                                         heldout_fraction=0.3 if args.small else 0.04))
        except OSError as exc:
            raise CliError(f"cannot prepare {data}: {exc}") from None
    if args.prepare_only:
        return 0
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device here; use --device cpu", code=2)
    train = TrainOptions(seed=args.seed)
    if args.small:
        train = dataclasses.replace(train, steps=4, batch=2, seq_len=64, anchors=4, warmup=2, log_every=1)
    given = {k: v for k, v in (("steps", args.steps), ("batch", args.batch), ("seq_len", args.seq_len),
                               ("stop_after", args.stop_after)) if v is not None}
    if args.max_minutes is not None:
        given["max_seconds"] = 60.0 * args.max_minutes
    train = dataclasses.replace(train, **given)
    options = RunOptions(train=train, sizes=dict(sizes), device=device)
    if args.small:
        options = dataclasses.replace(options, eval_batch=4, dspark_prompts=4, dspark_prompt_len=32, dspark_new=16,
                                      headers=4, header_tokens=24, sample_tokens=12, trace_steps=50,
                                      eval_tokens=1000)
    if args.with_drafter_phase:
        options = dataclasses.replace(options, drafter=_drafter_options(args))
    try:
        if args.drafter_phase or args.eval_only:
            _again(args, data, out, options)
        else:
            train_run(data, out, options)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None
    return 0


def _again(args, data: Path, out: Path, options) -> None:
    import json

    from deepinfer.engine.models.deepseek_v41.training import run as r
    from deepinfer.engine.models.deepseek_v41.training.prepare import load_manifest

    if not (out / "model.safetensors").is_file():
        raise CliError(f"{out} has no checkpoint to continue from; train it first", code=2)
    generate = _engine_generate(out, options.device) if args.engine_generate else None
    if args.eval_only:
        previous = json.loads((out / r.EVAL_FILE).read_text()) if (out / r.EVAL_FILE).is_file() else {}
        report = {k: v for k, v in previous.items() if k in ("train", "model", "heldout_float", "drafter_phase")}
        report.update(r.evaluate(out, data, r.load_streams(data), load_manifest(data), options, generate=generate))
        r.write_json(out / r.EVAL_FILE, report)
        return
    r.drafter_phase(out, data, options, _drafter_options(args), generate=generate)


def _drafter_options(args):
    from deepinfer.engine.models.deepseek_v41.training.drafter_phase import DrafterOptions

    given = {k: v for k, v in (("steps", args.drafter_steps), ("sequences", args.drafter_sequences),
                               ("prompt_len", args.drafter_prompt_len), ("new", args.drafter_new)) if v is not None}
    if args.drafter_minutes is not None:
        given["max_seconds"] = 60.0 * args.drafter_minutes
    return dataclasses.replace(DrafterOptions(seed=args.seed), **given)


def _engine_generate(model_dir: Path, device: str):
    """Greedy continuations by the serving engine on ``model_dir`` (reloaded by the caller's
    evaluation when the checkpoint changes: the engine is built per call)."""
    from deepinfer import LLM, SamplingParams

    def generate(prompts, max_new, stop_ids=()):
        llm = LLM(model=str(model_dir), dtype="float32", device=device)
        params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        new = []
        for o in outs:
            toks = list(o.outputs[0].token_ids)
            cut = next((i for i, t in enumerate(toks) if t in stop_ids), None)
            new.append(toks if cut is None else toks[: cut + 1])
        return new

    return generate
