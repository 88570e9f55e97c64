"""Routing traces recorded from the project's tiny DeepSeek-V4 model (``write_tiny_model``).

The model runs through ``LLM`` (scheduler, chunked prefill, continuous batching) on prompts cut
from this repository's own sources and docs. Each MoE layer's ``forward`` is wrapped to recompute
its gate on the same inputs (the CPU path routes inside one native call, so there is nothing to
hook) and count the tokens per expert; one engine step, one row. The weights are random, so the
skew is whatever a random router makes of real text: mild in the learned layers and shaped by
token frequencies in the two hash-routed ones (tid2eid). 16 experts, top-4; ``LAYERS`` (four:
window, window, CSA, HCA, the first two hash-routed) rather than the default eight, so that a
trace of a few hundred steps records in seconds on two cores.

    prefill trace: prompts with max_tokens=1 in steps of ``chunk_tokens`` scheduled tokens
    decode trace: ``num_seqs`` sequences sampling at temperature 1 (greedy on random weights
    repeats itself), from the first step without prompt tokens on (finished sequences are
    replaced, so later steps may carry a new prompt's chunk as continuous batching does)

The engine admits requests asynchronously, so which prompts share the first steps, and from
there the whole recording, varies a little from run to run; the planners replay one recording.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[3]
TEXT_DIRS = ("engine", "runtime", "cache", "transport", "kernels", "bin")
LAYERS = "WWCH"


def corpus() -> str:
    """This repository's Python and Markdown files, in a fixed order."""
    files = sorted(p for d in TEXT_DIRS for p in (REPO / d).rglob("*") if p.suffix in (".py", ".md"))
    files.insert(0, REPO / "README.md")
    return "\n".join(p.read_text(errors="replace") for p in files if p.is_file())


class _Recorder:
    """Wraps every layer's MoE forward; ``steps`` gets one [layers, experts] row per forward."""

    def __init__(self, model):
        self.layers = list(model.layers)
        self.num_experts = self.layers[0].mlp.experts.num_experts
        self.steps: list[np.ndarray] = []
        for index, layer in enumerate(self.layers):
            layer.mlp.forward = self._wrap(layer.mlp, index)

    def _wrap(self, moe, index):
        forward = moe.forward

        def counted(x, token_ids, num_tokens, batch_invariant):
            if index == 0:
                self.steps.append(np.zeros((len(self.layers), self.num_experts)))
            route = moe.gate.forward(x, token_ids, num_tokens, False)
            ids = route.expert_ids.reshape(-1).cpu().numpy()
            self.steps[-1][index] += np.bincount(ids, minlength=self.num_experts)
            return forward(x, token_ids, num_tokens, batch_invariant)

        return counted

    def take(self) -> np.ndarray:
        out = np.stack(self.steps) if self.steps else np.zeros((0, len(self.layers), self.num_experts))
        self.steps = []
        return out


def record(prefill_steps: int, decode_steps: int, *, chunk_tokens: int = 512, num_seqs: int = 32,
           seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(prefill trace, decode trace): float arrays [steps, layers, experts], each cut to the
    requested number of steps (fewer if the text runs out)."""
    from deepinfer.engine.api.llm import LLM
    from deepinfer.engine.api.sampling_params import SamplingParams
    from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model

    rng = np.random.default_rng(seed)
    text = corpus()
    with tempfile.TemporaryDirectory(prefix="deepinfer-eplb-") as model_dir:
        write_tiny_model(model_dir, seed=seed, layers=LAYERS)
        llm = LLM(model=model_dir, dtype="float32", device="cpu", max_num_seqs=num_seqs, max_model_len=4096,
                  max_num_batched_tokens=chunk_tokens, enable_prefix_caching=False)
        try:
            recorder = _Recorder(llm.engine.core.runner.model)
            # prefill: prompts of log-normal length (median ~600 tokens) until enough steps
            chars_per_step = chunk_tokens * 3  # the tiny BPE makes ~1.5-2 characters per token
            need = prefill_steps * chars_per_step
            start = int(rng.integers(0, max(1, len(text) - need)))
            prompts, pos = [], start
            while pos < start + need and pos < len(text):
                n = int(min(rng.lognormal(np.log(1000), 0.8), 5000))
                prompts.append(text[pos : pos + n])
                pos += n
            llm.generate(prompts, SamplingParams(max_tokens=1))
            prefill = recorder.take()[:prefill_steps]
            # decode: short prompts, two waves of varied generation lengths
            per_seq = max(8, decode_steps // 2)
            offsets = rng.integers(0, len(text) - 400, size=2 * num_seqs)
            prompts = [text[o : o + 300] for o in offsets]
            params = [SamplingParams(max_tokens=int(rng.integers(per_seq // 2, 3 * per_seq // 2)), temperature=1.0,
                                     seed=int(rng.integers(1 << 30)), ignore_eos=True) for _ in prompts]
            llm.generate(prompts, params)
            steps = recorder.take()
            tokens = steps[:, 0].sum(axis=1) / llm.config.num_experts_per_tok  # [steps] tokens per step
            first = int(np.argmax(tokens <= num_seqs))  # the first wave's prompts are in
            decode = steps[first:][:decode_steps]
        finally:
            llm.shutdown()
    return prefill, decode
