"""The tiny-real-model half of ``bench_engine``: the engine on the ~18M-parameter V4 config.

- ``measure_cost_model``: profile the engine's cost model at start-up through its own runner
  (engine/sched/cost_profile.py), then run a held-out mixed workload (prefills of several lengths
  joining running decodes) and compare each step's prediction, made before the step runs, with
  its measured forward time.
- ``measure_vs_hf``: transformers' ``generate`` (greedy) next to our engine (EngineCore through
  the pipelined loop, i.e. scheduler, sampler and output processing included) on the same
  weights and prompts; also the bare forward loop of bench_model for the engine's own cost.

Same weights everywhere: ``hf_reference`` builds the transformers model and hands our runner
its state dict (bench_model's shape and timing helper are reused).
"""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from deepinfer_bench.bench_model import BENCH_SHAPE, hf_generate, our_generate
from deepinfer_bench.sync_steps import StepPipeline

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.sched.cost_model import CostModel
from deepinfer.engine.sched.cost_profile import profile_cost_model
from deepinfer.engine.sched.scheduler import SchedulerConfig

BLOCK_SIZE = 128
STEP_CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def build_reference(seed: int = 0, quick: bool = False):
    """The issue's ~18M-parameter shape; ``quick``: the test suite's tiny shape (seconds to build)."""
    from deepinfer.engine.models.deepseek_v4.testing import hf_reference

    ref = hf_reference(seed=seed) if quick else hf_reference(seed=seed, **BENCH_SHAPE)
    ref.hf_model.generation_config.eos_token_id = None  # fixed-length generations on both sides
    return ref


def make_engine(ref, *, max_num_seqs: int, max_model_len: int, cost_model: CostModel | None = None,
                step_clock: str = "wall", prefix_caching: bool = True) -> EngineCore:
    cfg = ref.config
    blocks_per_seq = -(-max_model_len // BLOCK_SIZE)
    num_blocks = max_num_seqs * blocks_per_seq + 8
    runner = ModelRunner(cfg, ref.state_dict, num_blocks=num_blocks, num_slots=max_num_seqs, block_size=BLOCK_SIZE)
    sched = SchedulerConfig(block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                            max_replay_tokens=cfg.sliding_window * cfg.num_hidden_layers, model_id="bench-tiny",
                            enable_prefix_caching=prefix_caching)
    return EngineCore(runner, EngineCoreConfig(sched, num_blocks=num_blocks, vocab_size=cfg.vocab_size),
                      cost_model=cost_model, seed_rng=random.Random(0), step_timer=STEP_CLOCKS[step_clock])


def engine_generate(core: EngineCore, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Greedy ``new_tokens`` per prompt through the engine's step pipeline; (seconds, tokens per prompt)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    with ThreadPoolExecutor(1) as ex:
        pipe = StepPipeline(core, ex)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            core.add_request(f"g{i}", p, params)
            tokens[f"g{i}"] = []
        while pipe.has_work():
            for out in pipe.step():
                tokens[out.request_id] += out.outputs[0].token_ids
        seconds = time.perf_counter() - t0
    return seconds, [tokens[f"g{i}"] for i in range(len(prompts))]


def measure_vs_hf(ref, batches: list[int], prompt_len: int, new_tokens: int, repeats: int = 1,
                  seed: int = 1) -> list[dict]:
    """Per batch size, ``repeats`` rounds of transformers / engine / bare forward back to back;
    the best time of each side counts (the machine is shared)."""
    g = torch.Generator().manual_seed(seed)
    vocab = ref.config.vocab_size
    rows = []
    for b in batches:
        prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(b)]
        # No prefix cache: rounds repeat the prompts (transformers reuses nothing either), and the
        # bare loop writes the same runner's KV blocks, which cached blocks would point into.
        core = make_engine(ref, max_num_seqs=b, max_model_len=prompt_len + new_tokens + 8, prefix_caching=False)
        engine_generate(core, prompts[:1], 2)  # warm-up (first-call allocations)
        hf_s = ours_s = bare_s = float("inf")
        for _ in range(repeats):
            s, hf_tokens = hf_generate(ref, prompts, new_tokens)
            hf_s = min(hf_s, s)
            s, ours_tokens = engine_generate(core, prompts, new_tokens)
            ours_s = min(ours_s, s)
            s, _ = our_generate(core.runner, prompts, new_tokens, -(-(prompt_len + new_tokens) // BLOCK_SIZE))
            bare_s = min(bare_s, s)
        rows.append({
            "batch": b, "hf_tok_s": b * new_tokens / hf_s, "engine_tok_s": b * new_tokens / ours_s,
            "bare_forward_tok_s": b * new_tokens / bare_s,
            "same_tokens": sum(a == h for a, h in zip(ours_tokens, hf_tokens)),
        })  # fmt: skip
    return rows


def measure_cost_model(ref, *, quick: bool, step_clock: str, num_eval: int, seed: int = 2) -> dict:
    """Start-up profile, then the median relative error of predictions on held-out real steps."""
    model = CostModel(refit_every=16)
    max_len = 1024 if quick else 2304
    core = make_engine(ref, max_num_seqs=8, max_model_len=max_len, cost_model=model, step_clock=step_clock)
    profile_cost_model(core, prompt_lens=(32, 256, 900) if quick else (32, 128, 512, 1024, 2048),
                       decode_batches=(1, 4) if quick else (1, 2, 4, 8), decode_context=128,
                       decode_tokens=4 if quick else 6)  # fmt: skip
    rng = random.Random(seed)
    vocab = ref.config.vocab_size
    lens = (20, 150, 600) if quick else (20, 100, 300, 700, 1500)
    for i in range(12 if quick else 32):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice(lens))]
        max_tokens = rng.randint(2, 24 if quick else 48)
        core.add_request(f"c{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    errs, errs_wall, seconds = [], [], []
    while core.has_unfinished_requests() and len(errs) < num_eval:
        plan = core.schedule_step()
        if plan.is_empty:
            continue
        predicted = model.predict(plan.sched.features)  # before the step runs (online refits included)
        t0 = time.perf_counter()
        logits = core.execute(plan)
        wall = time.perf_counter() - t0
        errs.append(abs(predicted - plan.exec_seconds) / plan.exec_seconds)
        errs_wall.append(abs(predicted - wall) / wall)
        seconds.append(plan.exec_seconds)
        core.commit_step(plan, core.sample_step(plan, logits))
    return {"median_rel_err": statistics.median(errs), "median_rel_err_wall": statistics.median(errs_wall),
            "steps": len(errs), "coef": model.coef,
            "median_step_ms": statistics.median(seconds) * 1e3}
