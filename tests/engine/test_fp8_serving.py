"""Serving V4 and V4.1 with FP8 weights (``quantization="fp8"``, kernels/fp8.py) on the CPU, where
their GEMMs run the torch reference: which weights turn FP8 and what memory that frees, the FP8
branches of the model compute the dense model's function (checked with an exact stand-in for the
rounding), a random V4 stays within a few times bfloat16's error of float32, the trained tiny
V4.1 keeps its held-out loss, and the engine serves it with one-line errors for what it cannot do."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.core.model_runner import ModelRunner, QuantizationError
from deepinfer.engine.core.options import EngineOptions, EngineOptionsError
from deepinfer.engine.models.deepseek_v4 import moe as v4_moe
from deepinfer.engine.models.deepseek_v4.testing import PARITY_CONFIGS, hf_reference
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.kernels import fp8
from deepinfer.kernels.fp8 import Fp8Weight

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]
CONFIGS = ("mixed_hc2", "hc3_csa2_wide")


def _runner(ref, **kw) -> ModelRunner:
    return ModelRunner(ref.config, ref.state_dict, num_blocks=64, num_slots=2, block_size=16, **kw)


def _logits(runner: ModelRunner, length: int = 150) -> torch.Tensor:
    prompt = [(7 * i + 3) % runner.config.vocab_size for i in range(length)]
    steps = [SeqStep(0, 0, list(range(-(-length // 16))), 0, prompt, num_logits=length)]
    return runner.execute(ForwardBatch(steps)).float()


@pytest.fixture(scope="module", params=CONFIGS)
def ref(request):
    return hf_reference(seed=4, **PARITY_CONFIGS[request.param])


def test_fp8_weights_replace_the_checkpoints_fp8_and_fp4_tensors(ref):
    dense, quant = _runner(ref), _runner(ref, quantization="fp8")
    for a, b in zip(dense.model.layers, quant.model.layers):
        attn, moe = b.self_attn, b.mlp
        assert isinstance(attn.w_in_fp8, Fp8Weight) and attn.w_in_fp8.shape[0] == sum(attn.in_sizes[:2])
        assert isinstance(attn.w_qb, Fp8Weight) and isinstance(attn.w_o_b, Fp8Weight)
        assert isinstance(attn.w_o_a, torch.Tensor)  # o_a is not FP8 in DeepSeek's checkpoints
        rest = a.self_attn.w_in[sum(a.self_attn.in_sizes[:2]):]
        assert (attn.w_in is None and rest.shape[0] == 0) or torch.equal(attn.w_in, rest)
        for w in (moe.shared_experts.gate_up, moe.shared_experts.w_down, moe.experts.gate_up_proj, moe.experts.down_proj):
            assert isinstance(w, Fp8Weight)
        assert torch.equal(moe.gate.weight, a.mlp.gate.weight)  # the router stays dense
    # the dense copies are gone: parameters shrink by the bytes now held in FP8 (1 byte + scales)
    dense_bytes = sum(p.nbytes for p in dense.model.parameters())
    fp8_bytes = sum(w.nbytes for w in _fp8_weights(quant.model))
    freed = dense_bytes - sum(p.nbytes for p in quant.model.parameters())
    assert freed > 0 and fp8_bytes < 0.3 * freed + 4096  # float32 -> E4M3 is 4 bytes -> 1 (+ scales)


def _fp8_weights(model):
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        yield from (a.w_in_fp8, a.w_qb, a.w_o_b, m.shared_experts.gate_up, m.shared_experts.w_down,
                    m.experts.gate_up_proj, m.experts.down_proj)


def test_fp8_branches_compute_the_dense_function(ref, monkeypatch):
    """With the rounding replaced by an exact stand-in (weights keep their dense values, inputs
    are not rounded), the FP8 model must equal the dense one: every split, fused and routed path
    that takes an Fp8Weight is wired to the same matrices and inputs."""

    class Exact(Fp8Weight):
        __slots__ = ("dense",)

        def __getitem__(self, i):
            return _exact(super().__getitem__(i), self.dense[i])

        def dequantize(self, dtype=torch.float32):
            return self.dense.to(dtype)

    def _exact(w: Fp8Weight, dense: torch.Tensor) -> Exact:
        out = Exact(w.data, w.scale)
        out.dense = dense.detach().clone()
        return out

    real_quantize = Fp8Weight.quantize.__func__
    monkeypatch.setattr(Fp8Weight, "quantize", classmethod(lambda cls, w, fmt="float": _exact(real_quantize(cls, w, fmt), w)))
    real_stacked = v4_moe.stacked_fp8
    monkeypatch.setattr(v4_moe, "stacked_fp8", lambda w, fmt: _exact(real_stacked(w, fmt), w))
    monkeypatch.setattr(fp8, "quantize_rows", lambda x: (x.float(), torch.ones(*x.shape[:-1], fp8.num_blocks(x.shape[-1]))))
    monkeypatch.setattr(fp8, "dequantize_rows", lambda q, s: q)
    dense, quant = _logits(_runner(ref)), _logits(_runner(ref, quantization="fp8"))
    assert (quant - dense).norm() <= 1e-5 * dense.norm()


def test_fp8_error_is_within_a_few_times_bfloat16s(ref):
    """Random tiny models amplify rounding (bfloat16 alone moves their logits by ~10-20 %); FP8
    rounds weights and GEMM inputs to 3 mantissa bits instead of 8, so its error is larger but of
    the same kind: bounded by a small multiple of bfloat16's on the same model and prompt."""
    exact = _logits(_runner(ref))
    bf16 = _logits(_runner(ref, dtype=torch.bfloat16))
    quant = _logits(_runner(ref, quantization="fp8"))
    err_bf16 = (bf16 - exact).norm() / exact.norm()
    err_fp8 = (quant - exact).norm() / exact.norm()
    assert 0 < err_fp8 <= 4 * err_bf16, (float(err_fp8), float(err_bf16))
    assert (quant.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v4_fp8")
    write_tiny_model(path, seed=3, layers="WCHC")
    return path


def test_llm_serves_fp8_weights(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4,
              quantization="fp8")
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = ["fibre between buildings", "the quick brown fox", {"prompt_token_ids": [5, 6, 7, 8, 9, 40]}]
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
        assert together == alone and all(len(t) == 12 for t in together)  # batch-invariant on the CPU
    finally:
        llm.shutdown()


def test_unsupported_quantization_fails_with_one_line(model_dir):
    with pytest.raises(EngineOptionsError, match="quantization must be one of fp8 or None, got 'int4'"):
        EngineOptions(quantization="int4")
    ref = hf_reference(seed=1, **PARITY_CONFIGS["mixed_hc2"])
    with pytest.raises(QuantizationError, match="quantization must be one of fp8"):
        _runner(ref, quantization="fp4")


def _heldout_nll(llm, texts) -> float:
    outs = llm.generate(texts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    nll = [-pl[t].logprob for o in outs for pl, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
    return sum(nll) / len(nll)


def test_trained_v41_keeps_its_heldout_loss_with_fp8_weights():
    """The shipped trained tiny V4.1 on held-out code (12 functions, ~2,300 tokens): FP8 weights
    cost it almost nothing (measured: 3.2195 -> 3.2219 nats a token)."""
    import json

    from deepinfer.engine.models.deepseek_v41.builtin_checkpoint import builtin_checkpoint

    model = builtin_checkpoint()
    texts = [h["header"] + h["body"] for h in json.loads((model / "heldout_headers.json").read_text())[:12]]
    nll = {}
    for quantization in (None, "fp8"):
        llm = LLM(model=str(model), device="cpu", max_model_len=1024, max_num_seqs=4, quantization=quantization)
        try:
            nll[quantization] = _heldout_nll(llm, texts)
        finally:
            llm.shutdown()
    assert abs(nll["fp8"] - nll[None]) <= 0.01, nll


def test_dspark_over_fp8_weights_keeps_greedy_outputs():
    """The drafter (dense) proposes for the FP8 target: verification keeps greedy outputs exact."""
    from deepinfer.engine.models.deepseek_v41.builtin_checkpoint import builtin_checkpoint

    prompts = ["def fibonacci(n):\n", "import os\n\ndef list_files(path):\n"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens, accepted = {}, 0
    for mode in ("off", "dspark"):
        llm = LLM(model=str(builtin_checkpoint()), device="cpu", max_model_len=256, max_num_seqs=2,
                  quantization="fp8", speculative=mode)
        try:
            tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            if mode == "dspark":
                accepted = llm.engine.core.spec.stats.num_accepted
        finally:
            llm.shutdown()
    assert tokens["dspark"] == tokens["off"] and accepted > 0


def test_v41_official_numerics_refuse_fp8_weights(monkeypatch):
    from deepinfer.engine.models.deepseek_v41.builtin_checkpoint import builtin_checkpoint

    from deepinfer import envs

    monkeypatch.setattr(envs, "_snapshot", envs.load({"DEEPINFER_V41_NUMERICS": "official"}))
    with pytest.raises(ValueError, match="FP8 weights serve V4.1's float numerics only"):
        LLM(model=str(builtin_checkpoint()), device="cpu", max_model_len=128, max_num_seqs=2, quantization="fp8")



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_on_cuda_keeps_the_trained_v41s_heldout_loss(dtype):
    """The Triton FP8 GEMMs (dense, grouped, routed experts) in the whole engine on the GPU, CUDA
    graphs on: the trained tiny V4.1's held-out loss stays with the CPU float model's (the CPU's
    FP8 reference is 0.0024 nats above it), and greedy generation runs through graphed decodes."""
    import json

    from deepinfer.engine.models.deepseek_v41.builtin_checkpoint import builtin_checkpoint

    model = builtin_checkpoint()
    texts = [h["header"] + h["body"] for h in json.loads((model / "heldout_headers.json").read_text())[:12]]
    cpu = LLM(model=str(model), device="cpu", max_model_len=1024, max_num_seqs=4)
    try:
        want = _heldout_nll(cpu, texts)
    finally:
        cpu.shutdown()
    gpu = LLM(model=str(model), device="cuda", dtype=dtype, max_model_len=1024, max_num_seqs=4, quantization="fp8")
    try:
        got = _heldout_nll(gpu, texts)
        outs = gpu.generate(texts[:4], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    finally:
        gpu.shutdown()
    assert abs(got - want) <= (0.01 if dtype == "float32" else 0.03), (got, want)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
