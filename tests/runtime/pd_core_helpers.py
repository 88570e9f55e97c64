"""What the P/D tests on real tiny cores share: a mixed request set, stepping a core to the
end, and the exact-equality check against a co-located run (load with
``load_test_helper("runtime/pd_core_helpers")``)."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.text.output_processor import merge_output
from tests.conftest import load_test_helper

sync_steps = load_test_helper("bench/sync_steps")


def mixed_requests(num: int, seed: int, *, vocab: int = 4000, prompt_lens=((5, 60), (60, 260)),
                   max_tokens=(6, 24), prompt_logprobs: bool = False) -> list[tuple[str, list[int], SamplingParams, int]]:
    """(request id, prompt, params, seed) cycling through the sampling paths: greedy, seeded
    top-p, seeded with penalties and logprobs, greedy with min_tokens (EOS allowed after it)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*rng.choice(prompt_lens)))]
        num_tokens = rng.randint(*max_tokens)
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=num_tokens, ignore_eos=True)
        elif kind == 2:
            params = SamplingParams(temperature=0.7, seed=7 + i, max_tokens=num_tokens, presence_penalty=0.5,
                                    frequency_penalty=0.3, repetition_penalty=1.2, logprobs=2, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=num_tokens, min_tokens=3, logprobs=1,
                                    prompt_logprobs=1 if prompt_logprobs else None)
        reqs.append((f"r{seed}-{i}", prompt, params, 1000 + i))
    return reqs


def run_to_end(core, max_steps: int = 5000) -> dict:
    """Step ``core`` until it is idle; request id -> merged output (integrity checked per step)."""
    acc = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return acc
        for out in sync_steps.step(core):
            acc[out.request_id] = merge_output(acc.get(out.request_id), out)
        core.check_integrity()
    raise AssertionError(f"the core did not finish within {max_steps} steps")


def assert_same_outputs(got: dict, want: dict, request_ids) -> None:
    """Tokens, text, finish reason, logprobs and prompt logprobs equal the co-located run's."""
    for rid in request_ids:
        g, w = got[rid].outputs[0], want[rid].outputs[0]
        assert g.token_ids == w.token_ids, rid
        assert g.text == w.text, rid
        assert g.finish_reason == w.finish_reason, rid
        if w.logprobs is not None:
            assert [sorted(p) for p in g.logprobs] == [sorted(p) for p in w.logprobs], rid
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-5), rid
        if want[rid].prompt_logprobs is not None:
            assert got[rid].prompt_logprobs == want[rid].prompt_logprobs, rid
