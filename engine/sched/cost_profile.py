"""Start-up profiling for the chunk-size cost model: time real steps of synthetic requests.

Prefill shapes come from prompts of several lengths, each run whole (``p = 0``) and again in
``num_chunks`` chunks (the token budget lowered for the run, so chunk ``n`` lands on prefixes
``p = 0, n, 2n, ...``): without chunks at non-zero prefixes the ``n * p`` attention term is not
identifiable and the fit may put any value there. Decode shapes come from batches of short
requests generating a few tokens. Every forward goes through the engine's own runner, so the fit sees the true cost of
this model on this device. The measurements are kept for good (``CostModel.add_profile``);
online steps refine the fit afterwards.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.engine_core import EngineCore
from deepinfer.engine.core.step_loop import FailurePolicy, FailureScope, StepHooks, StepLoop
from deepinfer.engine.sched.cost_model import CostModel

PROFILE_SALT = "__deepinfer_cost_profile__"


def profile_cost_model(
    core: EngineCore,
    *,
    prompt_lens: Sequence[int] = (64, 512, 2048, 8192),
    decode_batches: Sequence[int] = (1, 8, 32),
    decode_context: int = 256,
    decode_tokens: int = 8,
    num_chunks: int = 4,
    seed: int = 0,
) -> CostModel:
    """Profile ``core`` (idle, with a cost model) and refit its cost model; returns it."""
    model = core.cost_model
    if model is None:
        raise ValueError("profile_cost_model needs an EngineCore built with cost_model=CostModel()")
    if core.has_unfinished_requests():
        raise ValueError("profile the engine before it takes requests")
    sc = core.config.scheduler
    rng = random.Random(seed)
    vocab = core.config.vocab_size
    max_len = sc.max_model_len - 1

    def run(prompts: list[int], max_tokens: int, budget: int | None = None) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        for i, n in enumerate(prompts):
            tokens = [rng.randrange(vocab) for _ in range(min(n, max_len - max_tokens))]
            core.add_request(f"{PROFILE_SALT}{run.calls}-{i}", tokens, params, cache_salt=PROFILE_SALT)
        run.calls += 1
        if budget is not None:
            core.scheduler.config = replace(sc, max_num_batched_tokens=budget)
        try:
            _drain()
        finally:
            core.scheduler.config = sc

    def _drain() -> None:
        core.cost_model = _ProfileSamples(model)  # each step's time: a profile sample, not an online one
        try:
            asyncio.run(_run_serial(core))
        finally:
            core.cost_model = model

    run.calls = 0
    for n in prompt_lens:
        run([n], 1)
        chunk = -(-n // num_chunks)
        if num_chunks > 1 and chunk < min(n, sc.max_num_batched_tokens):
            run([n], 1, budget=chunk)
    for b in decode_batches:
        run([decode_context] * min(b, sc.max_num_seqs), decode_tokens)
    core.scheduler.pool.evict_all_unreferenced()  # profile prompts are not worth caching
    core.drain_kv_events()
    model.refit()
    return model


class _ProfileSamples:
    """Stands in for the cost model at commit: step times become profile samples."""

    def __init__(self, model: CostModel) -> None:
        self._model = model

    def observe(self, features, seconds: float) -> None:
        self._model.add_profile(features, seconds)


def _raise(request_ids: list[str], error: Exception) -> None:
    raise error  # a failed profiling step fails the profile


async def _run_serial(core: EngineCore) -> None:
    """Step ``core`` with the engine's step loop (serial) until every request has finished."""
    with ThreadPoolExecutor(1, thread_name_prefix="deepinfer-profile") as device:
        steps = StepLoop(core, device, StepHooks(deliver=lambda outputs: None, fail=_raise), name="cost-profile",
                         is_pipelined=False, failure=FailurePolicy(FailureScope.SCHEDULED, evict_prefix_cache=False))
        steps.close()  # run returns once nothing is left to step
        await steps.run()
