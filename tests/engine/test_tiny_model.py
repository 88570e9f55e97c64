"""`deepinfer make-tiny-model`: deterministic, complete, a real V4 checkpoint (transformers loads it)."""

import json
import subprocess
import sys

import pytest
import torch

from deepinfer.bin.cli import main
from deepinfer.engine.loader.weights import load_checkpoint
from deepinfer.engine.models.deepseek_v4.checkpoint_names import is_expert_tensor, is_fp8_linear
from deepinfer.engine.models.deepseek_v4.config import CSA, HCA, SLIDING
from deepinfer.engine.models.deepseek_v4.tiny_model import (
    TinyModelError,
    init_weights,
    parse_layers,
    tiny_config,
    write_tiny_model,
)
from deepinfer.engine.text.tokenizer import Tokenizer

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def make_tiny_model(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deepinfer.bin", "make-tiny-model", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Seed 0 written by two real CLI processes at once (tokenizer training and hashing differ per
    process); seed 1 and DeepSeek's FP8 layout written in-process."""
    root = tmp_path_factory.mktemp("tiny")
    procs = {"a": make_tiny_model(root / "a", "--seed", "0"), "b": make_tiny_model(root / "b")}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err
            assert f"tiny checkpoint to {root / name}" in out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    write_tiny_model(root / "c", seed=1)
    write_tiny_model(root / "native_fp8", seed=0, native=True, fp8=True)
    return {name: root / name for name in ("a", "b", "c", "native_fp8")}


@pytest.mark.timeout(600)
def test_same_seed_same_bytes_different_seed_different_weights(dirs):
    for name in FILES:
        assert (dirs["a"] / name).read_bytes() == (dirs["b"] / name).read_bytes(), name
    assert (dirs["a"] / "model.safetensors").read_bytes() != (dirs["c"] / "model.safetensors").read_bytes()
    assert (dirs["a"] / "tokenizer.json").read_bytes() == (dirs["c"] / "tokenizer.json").read_bytes()


def test_default_config_has_every_layer_kind_and_a_long_context(dirs):
    cfg, tensors = load_checkpoint(dirs["a"], torch.float32, progress=False)
    assert cfg == tiny_config()
    assert cfg.layer_types == (SLIDING, SLIDING, CSA, HCA, CSA, HCA, CSA, HCA)
    assert cfg.num_hash_layers == 2 and cfg.n_routed_experts == 16 and cfg.num_experts_per_tok == 4
    assert cfg.max_position_embeddings >= 8192 and cfg.vocab_size == 4096 and cfg.hidden_size == 256
    assert cfg.sliding_window == 128 and cfg.hc_mult == 4 and cfg.rope_compress.rope_type == "yarn"
    num_params = sum(t.numel() for t in tensors.values() if t.is_floating_point())
    assert 15e6 < num_params < 20e6
    # the stored weights are the seeded init, rounded to bfloat16 outside the float32 tensors
    for name, ref in init_weights(cfg, seed=0).items():
        assert torch.equal(tensors[name], ref if tensors[name].dtype == torch.int64 or name.endswith(
            ("sinks", "position_bias", "bias", "norm.weight", "fn", "base", "scale")) else ref.bfloat16().float()), name
    _, auto = load_checkpoint(dirs["a"], "auto", progress=False)  # the checkpoint's own dtype
    assert auto["embed_tokens.weight"].dtype == torch.bfloat16 and auto["norm.weight"].dtype == torch.float32
    tid2eid = tensors["layers.0.mlp.gate.tid2eid"]
    assert all(len(set(row)) == 4 for row in tid2eid.tolist()[:512])  # distinct experts per token
    assert tensors["layers.3.self_attn.sinks"].abs().min() > 0
    assert tensors["layers.3.mlp.gate.e_score_correction_bias"].abs().min() > 0


@pytest.mark.timeout(600)
def test_transformers_loads_it_and_its_predictions_vary(dirs):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["a"], dtype=torch.float32).eval()
    _, ours = load_checkpoint(dirs["a"], torch.float32, progress=False)
    hf = {k.removeprefix("model."): v for k, v in model.state_dict().items()}
    assert sorted(hf) == sorted(ours)
    assert all(torch.equal(hf[k], ours[k]) for k in hf)
    tok = Tokenizer.from_dir(dirs["a"])
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about the model cache, 你好!"}],
                                  add_generation_prompt=True, tokenize=True)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    assert torch.isfinite(logits).all()
    assert len(set(logits.argmax(-1).tolist())) > len(ids) // 3  # non-degenerate next-token choices


def test_native_fp8_layout_loads_to_the_same_model(dirs):
    cfg, plain = load_checkpoint(dirs["a"], torch.float32, progress=False)
    native_cfg, quantised = load_checkpoint(dirs["native_fp8"], torch.float32, progress=False)
    config = json.loads((dirs["native_fp8"] / "config.json").read_text())
    assert config["compress_ratios"] == [0, 0, 4, 128, 4, 128, 4, 128] and config["num_hash_layers"] == 2
    assert config["expert_dtype"] == "fp4" and config["quantization_config"]["scale_fmt"] == "ue8m0"
    assert native_cfg.layer_types == cfg.layer_types and native_cfg.rope_compress == cfg.rope_compress
    for name, ref in plain.items():
        got = quantised[name]
        if is_fp8_linear(name) or is_expert_tensor(name):
            bound = 2 ** -4 if is_fp8_linear(name) else 0.2  # MXFP4 keeps ~1 significant bit
            assert ((got - ref).norm() / ref.norm()).item() < bound, name
        else:
            assert torch.equal(got, ref), name


def test_tokenizer_of_the_checkpoint(dirs):
    tok = Tokenizer.from_dir(dirs["a"])
    for text in ("plain ASCII text", "多字节 UTF-8 ✓ 😀 café"):
        assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert chat == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"


def test_layers_option_and_bad_input(tmp_path, capsys):
    assert parse_layers("0,4,128") == (SLIDING, CSA, HCA)
    assert parse_layers("wch") == (SLIDING, CSA, HCA)
    assert tiny_config("CH", num_hash_layers=1).compress_ratios == (4, 128)
    with pytest.raises(TinyModelError, match="ratio 8"):
        parse_layers("0,8")
    with pytest.raises(TinyModelError, match="hash-layers 5"):
        tiny_config("WCH", num_hash_layers=5)
    assert main(["make-tiny-model", str(tmp_path / "x"), "--layers", "WXH"]) == 1
    err = capsys.readouterr().err
    assert "letter 'X'" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "file").write_text("")
    assert main(["make-tiny-model", str(tmp_path / "file")]) == 1
    assert "not a directory" in capsys.readouterr().err
