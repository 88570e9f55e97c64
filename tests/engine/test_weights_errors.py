"""Malformed checkpoint directories fail before loading, with one line naming the problem."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.engine.loader.checkpoint_writer import Layout, save_checkpoint
from deepinfer.engine.loader.weights import CheckpointError, load_checkpoint
from deepinfer.engine.models.deepseek_v4.tiny_model import init_weights, tiny_config


@pytest.fixture(scope="module")
def cfg():
    return tiny_config("WCH", num_hash_layers=1)


@pytest.fixture(scope="module")
def weights(cfg):
    return init_weights(cfg, seed=5)


def write(path, cfg, weights, layout=Layout()):
    save_checkpoint(path, cfg, weights, layout)
    return path


def rewrite(path, edit):
    """Apply ``edit`` to the tensors of the single model.safetensors file."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def load_error(path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, torch.float32, progress=False, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_tensor_is_named(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights)
    rewrite(tmp_path, lambda t: t.pop("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"))
    message = load_error(tmp_path)
    assert "missing tensor 'layers.1.self_attn.compressor.indexer.q_b_proj.weight'" in message


def test_missing_expert_of_a_native_checkpoint_is_named(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights, Layout(native=True))
    rewrite(tmp_path, lambda t: t.pop("layers.2.ffn.experts.5.w3.weight"))
    message = load_error(tmp_path)
    assert "layers.2.mlp.experts.gate_up_proj" in message and "expert 5 up" in message


def test_wrong_shape_is_named_with_both_shapes(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights)
    rewrite(tmp_path, lambda t: t.update({"model.layers.0.self_attn.kv_proj.weight": torch.zeros(32, 256)}))
    message = load_error(tmp_path)
    assert "'model.layers.0.self_attn.kv_proj.weight'" in message and "(32, 256)" in message and "(64, 256)" in message


def test_unexpected_tensor_is_named(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights)
    rewrite(tmp_path, lambda t: t.update({"model.layers.0.self_attn.compressor.kv_proj.weight": torch.zeros(64, 256)}))
    message = load_error(tmp_path)
    assert "unexpected tensor 'model.layers.0.self_attn.compressor.kv_proj.weight'" in message


def test_expected_shapes_that_disagree_name_the_tensor(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights)
    from deepinfer.engine.models.deepseek_v4.checkpoint_names import canonical_shapes

    expected = dict(canonical_shapes(cfg))
    expected["norm.weight"] = (512,)
    assert "'model.norm.weight'" in load_error(tmp_path, expected=expected)


def test_unknown_model_type_names_it_and_the_supported_ones(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    message = load_error(tmp_path)
    assert "'llama'" in message and "deepseek_v4" in message


def test_missing_config_json(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights)
    os.remove(tmp_path / "config.json")
    assert "has no config.json" in load_error(tmp_path)


def test_no_weight_files(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights)
    os.remove(tmp_path / "model.safetensors")
    assert "no *.safetensors" in load_error(tmp_path)


def test_index_naming_a_missing_shard(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights, Layout(max_shard_bytes=4 << 20))
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    os.remove(shards[-1])
    message = load_error(tmp_path)
    assert shards[-1].name in message and "does not exist" in message


def test_scale_that_does_not_tile_its_weight(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights, Layout(native=True, quantize=True, expert_dtype="none"))
    rewrite(tmp_path, lambda t: t.update({"layers.0.attn.wq_b.scale": torch.ones(3, 3).to(torch.float8_e8m0fnu)}))
    message = load_error(tmp_path)
    assert "'layers.0.attn.wq_b.weight'" in message and "scale shape (3, 3)" in message


def test_corrupt_safetensors_file(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights)
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{not")
    assert "not a readable safetensors file" in load_error(tmp_path)


def test_bad_dtype_argument(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights)
    with pytest.raises(CheckpointError, match="dtype 'int8'"):
        load_checkpoint(tmp_path, "int8", progress=False)


def test_fp8_weight_without_its_scale(cfg, weights, tmp_path):
    write(tmp_path, cfg, weights, Layout(native=True, quantize=True, expert_dtype="none"))
    rewrite(tmp_path, lambda t: t.pop("layers.2.attn.wkv.scale"))
    message = load_error(tmp_path)
    assert "'layers.2.attn.wkv.weight'" in message and "no scale" in message
