"""The trained tiny V4.1 checkpoint shipped in the package: what `deepinfer serve` loads by default.

- complete, official layout, under the tree-size limit, and the default of ``default_model_dir``;
- the training forward and the engine agree on it (held-out text, every role selecting);
- (test_v41_builtin_serve.py: `deepinfer serve` with no --model streams Python that parses);
- its DSpark drafter keeps accepting drafts of the target's greedy text (a regression floor under
  the README figure), with the calibration stored beside it;
- its routing trace replays in `deepinfer bench eplb` and is skewed.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from deepinfer import LLM, SamplingParams
from deepinfer.engine.models.deepseek_v41.builtin_checkpoint import BUILTIN_DIR, builtin_checkpoint
from deepinfer.engine.models.deepseek_v41.config import V41Config
from deepinfer.engine.models.deepseek_v41.dspark import CALIBRATION_FILE, DSparkDrafter
from deepinfer.engine.models.deepseek_v41.training.dspark_eval import chain_steps, draft_outcomes
from deepinfer.engine.models.deepseek_v41.training.run import load_for_eval
from tests.conftest import load_bench_module, load_test_helper

dense = load_test_helper("engine/v41/test_v41_dense")

TRACE = BUILTIN_DIR.parents[3] / "tests" / "bench" / "eplb" / "trained_tiny_trace.npy"


@pytest.fixture(scope="module")
def headers():
    return json.loads((BUILTIN_DIR / "heldout_headers.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(BUILTIN_DIR / "tokenizer.json"))


def test_shipped_checkpoint_is_complete_and_the_default(monkeypatch):
    from deepinfer import envs
    from deepinfer.runtime.gateway.builtin_model import default_model_dir

    assert builtin_checkpoint() == BUILTIN_DIR
    total = sum(p.stat().st_size for p in BUILTIN_DIR.iterdir())
    assert total <= 20 * 1024 * 1024, total
    cfg = V41Config.from_dir(BUILTIN_DIR)
    assert cfg.quantization is not None and cfg.engram_layer_ids and cfg.num_stages == 2
    assert {r.name for r in cfg.roles} == {"window", "full", "reuse", "reindex"} and cfg.candidate_source_layer_id >= 0
    monkeypatch.delenv("DEEPINFER_BUILTIN_MODEL", raising=False)
    envs_now = envs.load()
    monkeypatch.setattr(envs, "get", lambda: envs_now)
    path, created, kind = default_model_dir()
    assert path == BUILTIN_DIR and not created and "trained" in kind
    calibration = json.loads((BUILTIN_DIR / CALIBRATION_FILE).read_text())
    assert len(calibration["temperatures"]) == cfg.dspark_block_size


def test_shipped_tokenizer_ends_prompts_on_line_start_boundaries(headers, tokenizer):
    # a header prompted with its newline (and the next line's indentation) ends on a token boundary
    # of the whole function: the model saw that boundary in training (training/bpe.py)
    for h in headers[:20]:
        whole = tokenizer.encode(h["header"] + h["body"]).ids
        indent = h["body"][: len(h["body"]) - len(h["body"].lstrip(" "))]
        for cut in (h["header"], h["header"] + indent):
            prefix = tokenizer.encode(cut).ids
            assert whole[: len(prefix)] == prefix, cut


def test_training_forward_equals_the_engine_on_the_shipped_checkpoint(headers, tokenizer):
    text = "".join(h["header"] + h["body"] for h in headers[:6])
    prompt = tokenizer.encode(text).ids[:300]  # past the 128-token window: compressed KV, top-k, pool
    assert len(prompt) == 300
    dense.assert_dense_matches_engine(BUILTIN_DIR, prompt)


def test_drafter_accepts_drafts_of_the_target_greedy_text(headers, tokenizer):
    torch.manual_seed(0)
    model = load_for_eval(BUILTIN_DIR, "cpu")
    drafter = DSparkDrafter(model)
    text = "".join(h["header"] + h["body"] for h in headers[10:40])
    ids = tokenizer.encode(text).ids
    prompts = [ids[i : i + 96] for i in range(0, 8 * 150, 150)]
    llm = LLM(model=str(BUILTIN_DIR), dtype="float32", device="cpu", max_model_len=1024)

    def generate(prompts, new, stop_ids=()):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]

    outcome = draft_outcomes(model, drafter, prompts, 48, generate)
    steps = np.array(chain_steps(outcome["accepted"]))
    # committed tokens per verification step (accepted drafts + 1): 2.11 on these prompts with the
    # shipped drafter, 2.01 on the evaluation's held-out prompts (README); a floor under both
    assert steps.mean() + 1 >= 1.8, steps.mean() + 1


def test_routing_trace_replays_and_is_skewed(tmp_path):
    trace = np.load(TRACE)
    cfg = V41Config.from_dir(BUILTIN_DIR)
    assert trace.shape[1:] == (cfg.num_hidden_layers, cfg.n_routed_experts) and trace.shape[0] >= 200
    loads = trace.sum(0)
    assert np.all(loads.max(-1) / loads.mean(-1) > 2.0)  # every layer visibly skewed
    out = tmp_path / "eplb.json"
    rc = load_bench_module("eplb").main(["--trace", str(TRACE), "--gpus", "4", "--redundant-per-gpu", "1",
                                         "--window", "50", "--period", "50", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and 1.0 <= data["file_ep4_ours"] < data["file_ep4_static"]
    assert os.path.getsize(TRACE) < 1024 * 1024
