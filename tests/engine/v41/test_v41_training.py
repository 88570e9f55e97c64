"""`deepinfer train-tiny` on the CPU: a few steps end to end, and the pure parts it is built from.

The CPU run prepares a 30-file slice of this interpreter's standard library, trains the small
model for a few steps (QAT on for the last ones), saves the official-layout checkpoint, reloads
and evaluates it; the engine then serves that checkpoint with the same logits as the training
forward. QAT's forward sees exactly the values the checkpoint stores.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from deepinfer.engine.models.deepseek_v41.engram import compressed_token_map
from deepinfer.engine.models.deepseek_v41.training import calibration as cal
from deepinfer.engine.models.deepseek_v41.training.bpe import train_tokenizer
from deepinfer.engine.models.deepseek_v41.training.corpus import SourceFile, function_headers, split_of
from deepinfer.engine.models.deepseek_v41.training.drafter_phase import DrafterOptions
from deepinfer.engine.models.deepseek_v41.training.evaluate import function_source, parses
from deepinfer.engine.models.deepseek_v41.training.model_setup import (
    SMALL_SIZES,
    build_model,
    disable_qat,
    enable_qat,
    quantised_tensors,
    training_config,
)
from deepinfer.engine.models.deepseek_v41.training.ngram import KneserNey
from deepinfer.engine.models.deepseek_v41.training.prepare import PrepareOptions, prepare
from deepinfer.engine.models.deepseek_v41.training.run import (
    RunOptions,
    distil_drafter,
    load_for_eval,
    load_streams,
    run,
    save_checkpoint,
)
from deepinfer.engine.models.deepseek_v41.training.trainer import TrainOptions, _steer_biases, zipf_targets
from deepinfer.engine.models.deepseek_v41.training.trainer import train as train_loop
from tests.conftest import load_test_helper

dense = load_test_helper("engine/v41/test_v41_dense")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "data"
    manifest = prepare(out, PrepareOptions(seed=0, vocab_size=SMALL_SIZES["vocab_size"], max_files=30,
                                           heldout_fraction=0.3), log=lambda *_: None)
    return out, manifest


def test_cpu_training_few_steps_end_to_end(small_data, tmp_path):
    data, manifest = small_data
    assert manifest["tokens"]["train"] > 10_000 and manifest["tokens"]["test"] > 500
    assert math.isfinite(manifest["ngram"]["test_nll"])
    train = TrainOptions(steps=3, batch=2, seq_len=48, anchors=3, warmup=1, log_every=1, qat_from=0.5)
    options = RunOptions(train=train, sizes=dict(SMALL_SIZES), device="cpu", eval_batch=4, dspark_prompts=2,
                         dspark_prompt_len=24, dspark_new=10, headers=2, header_tokens=10, sample_tokens=4,
                         trace_steps=20, eval_tokens=400,
                         drafter=DrafterOptions(sequences=4, prompt_len=16, new=12, steps=2, seqs_per_step=2, anchors=4,
                                                log_every=1))
    out = tmp_path / "ckpt"
    report = run(data, out, options, log=lambda *_: None)
    history = report["train"]["history"]
    assert [h["step"] for h in history] == [1, 2, 3] and all(math.isfinite(h["lm"]) for h in history)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "dspark_calibration.json", "eval.json", "routing_trace.npy"):
        assert (out / name).is_file(), name
    trace = np.load(out / "routing_trace.npy")
    c = load_for_eval(out, "cpu").config
    assert trace.shape[1:] == (c.num_hidden_layers, c.n_routed_experts)
    # every window's tokens are counted k times per layer
    assert np.all(trace.sum(-1) == trace.sum(-1)[:, :1]) and trace.sum(-1)[0, 0] % c.num_experts_per_tok == 0
    saved = json.loads((out / "eval.json").read_text())
    assert saved["heldout"]["tokens"] > 0 and set(saved["parse"]["rates"]) == {"as_written", "no_newline"}
    phase2 = saved["drafter_phase"]  # phase 2 ran on the saved checkpoint before the evaluation
    assert [h["step"] for h in phase2["history"]] == [1, 2] and phase2["tokens_per_step_before"] >= 1.0
    assert len(json.loads((out / "dspark_calibration.json").read_text())["temperatures"]) == c.dspark_block_size
    stream = np.load(data / "test.npy")[:90].astype(np.int64).tolist()
    dense.assert_dense_matches_engine(out, stream)


def test_qat_forward_sees_the_stored_weights(small_data, tmp_path):
    data, _ = small_data
    from tokenizers import Tokenizer

    from deepinfer.engine.models.deepseek_v41.engram import compressed_token_map

    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    cfg = training_config(compressed_token_map(tokenizer, SMALL_SIZES["vocab_size"])[1], SMALL_SIZES)
    model = build_model(cfg, data, 3, "cpu")
    found = quantised_tensors(model)
    assert {kind for _, _, kind in found} == {"fp8", "fp4", "table"}
    enable_qat(model)
    seen = {(id(m), a): getattr(m, a).detach().clone() for m, a, _ in found}
    disable_qat(model)
    save_checkpoint(model, cfg, data, tmp_path, 3)
    loaded = load_for_eval(tmp_path, "cpu")
    prefix_of = {id(m): p for p, m in model.named_modules()}
    stored = dict(loaded.named_parameters()) | dict(loaded.named_buffers())
    for module, attr, kind in found:
        name = f"{prefix_of[id(module)]}.{attr}"
        assert torch.equal(stored[name].float(), seen[(id(module), attr)].float()), name
        assert not torch.equal(getattr(module, attr).float(), seen[(id(module), attr)].float()), name  # rounding happened


def test_kneser_ney_is_a_distribution_and_beats_a_unigram():
    rng = np.random.default_rng(0)
    vocab = 50
    motifs = [rng.integers(0, vocab, size=5) for _ in range(8)]
    text = np.concatenate([motifs[i] for i in rng.integers(0, 8, size=3000)])
    lm = KneserNey(text[:12000], vocab, order=3)
    for history in ([motifs[0][0], motifs[0][1]], [3, 4], [49, 49]):
        probs = [math.exp(lm.logprobs(np.array([*history, w]))[-1]) for w in range(vocab)]
        assert abs(sum(probs) - 1) < 1e-9
    held = text[12000:]
    counts = np.bincount(text[:12000], minlength=vocab) + 1
    unigram = -np.log(counts[held[1:]] / counts.sum()).mean()
    assert -lm.logprobs(held).mean() < 0.5 * unigram


def test_ece_and_temperature_fit():
    assert cal.ece(np.array([0.9, 0.9, 0.1, 0.1]), np.array([1, 1, 0, 0])) == pytest.approx(0.1)
    assert cal.ece(np.array([0.5] * 4), np.array([1, 0, 1, 0])) == 0.0
    rng = np.random.default_rng(1)
    true_logit = rng.normal(0, 1.5, size=20000)
    outcome = (rng.random(20000) < cal.sigmoid(true_logit)).astype(float)
    t = cal.fit_temperature(3.0 * true_logit, outcome)  # a head three times overconfident
    assert 2.6 < t < 3.4
    assert cal.ece(cal.sigmoid(3.0 * true_logit / t), outcome) < cal.ece(cal.sigmoid(3.0 * true_logit), outcome)


def test_split_headers_and_function_bodies():
    assert split_of("json/decoder.py", 0, 0.04) == split_of("json/decoder.py", 0, 0.04)
    splits = [split_of(f"f{i}.py", 0, 0.2) for i in range(2000)]
    assert 0.75 < splits.count("train") / 2000 < 0.85
    assert 0.4 < splits.count("test") / (2000 - splits.count("train")) < 0.6
    text = "import os\n\ndef a(x):\n    return x\n\ndef b(x,\n      y):\n    pass\n\n@dec\ndef c():\n    pass\n"
    headers = function_headers([SourceFile("m.py", text)], 10)
    assert [h.header for h in headers] == ["def a(x):\n"]  # multi-line signatures and decorated ones skipped
    assert parses(function_source("def a(x):", "\n    y = x\n    return y\nprint(1)\n", cut_off=False))
    assert parses(function_source("def a(x):\n", "    y = x\n    return y\nprint(1)\n", cut_off=False))
    assert function_source("def a(x):", "\n    y = x\n    return (y", cut_off=True) == "def a(x):\n    y = x\n"
    assert not parses(function_source("def a(x):", "\nreturn x\n", cut_off=False))  # nothing indented
    # a prompt that ends in its newline: a first line back at column 0 ends an empty function
    assert not parses(function_source("def a(x):\n", "# a comment\n    return x\n", cut_off=False))
    assert not parses(function_source("def a(x):\n", "", cut_off=False))  # EOS at once: no body


def test_router_biases_move_towards_the_zipf_targets():
    targets = zipf_targets(3, 8, 2, 0.7, seed=0)
    assert torch.allclose(targets.sum(-1), torch.full((3,), 2.0)) and float(targets.max()) <= 1
    assert not torch.equal(targets[0], targets[1])  # each layer its own hot experts
    biases = [torch.zeros(8) for _ in range(3)]
    ids = [torch.tensor([[0, 1]] * 100) for _ in range(3)]  # every token on experts 0 and 1
    _steer_biases(biases, ids, targets, 0.01)
    for b in biases:
        assert torch.all(b[:2] == -0.01) and torch.all(b[2:] == 0.01)  # overloaded experts lose, idle ones gain


def test_tokenizer_keeps_line_starts_apart():
    # a prompt cut after a header's newline or after the next line's indentation must end on a
    # token boundary of the whole text: with the plain byte-level split "\n    " was one token and
    # a prompt ending in "\n" ended on a token seen in training only before column-0 text
    docs = ["def f(x):\n    return x\n\n\nclass A:\n    def g(self):\n        return 1\n" * 3] * 50
    tokenizer = train_tokenizer(docs, 400)
    text = "def h(y):\n    if y:\n        return y\n"
    whole = tokenizer.encode(text).ids
    for cut in ("def h(y):\n", "def h(y):\n    ", "def h(y):\n    if y:\n        "):
        prefix = tokenizer.encode(cut).ids
        assert whole[: len(prefix)] == prefix, cut
    assert tokenizer.decode(whole, skip_special_tokens=True) == text



def test_drafter_phase_changes_the_drafter_only(small_data, tmp_path):
    # phase 2 saves the whole checkpoint again: the target's weights as loaded (dequantised) must come
    # back exactly (its FP4 packing and Engram row scales may be re-chosen), only mtp.* may move
    data, _ = small_data
    tokenizer = Tokenizer.from_file(str(data / "tokenizer.json"))
    cfg = training_config(compressed_token_map(tokenizer, SMALL_SIZES["vocab_size"])[1], dict(SMALL_SIZES))
    train = TrainOptions(steps=1, batch=2, seq_len=48, anchors=3, warmup=1, log_every=1, qat_from=0.5)
    model = build_model(cfg, data, 0, "cpu")
    train_loop(model, load_streams(data)["train"], train, log=lambda *_: None)
    disable_qat(model)
    out = tmp_path / "ckpt"
    save_checkpoint(model, cfg, data, out, 0)
    before = {k: v.clone() for k, v in load_for_eval(out, "cpu").state_dict().items()}
    options = RunOptions(train=train, sizes=dict(SMALL_SIZES), device="cpu", dspark_prompts=2, dspark_prompt_len=24,
                         dspark_new=10)
    d = DrafterOptions(sequences=4, prompt_len=16, new=12, steps=3, seqs_per_step=2, anchors=4, lr=1e-2)
    record = distil_drafter(out, data, load_streams(data), options, d, log=lambda *_: None)
    after = load_for_eval(out, "cpu").state_dict()
    assert before.keys() == after.keys() and len(record["history"]) == 1
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("mtp.") for k in changed), sorted(k for k in changed if not k.startswith("mtp."))[:5]
