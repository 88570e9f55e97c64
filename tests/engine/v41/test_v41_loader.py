"""Loading official-layout V4.1 checkpoints: what is read, what is recognised and left, and the
one-line errors for broken directories; ``deepinfer make-tiny-model --arch deepseek_v41``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.bin import cli
from deepinfer.engine.loader.weights import CheckpointError
from deepinfer.engine.models.deepseek_v41.config import V41Config
from deepinfer.engine.models.deepseek_v41.loader import load_v41_checkpoint


def _copy(tiny_dir, tmp_path, edit=None, config_edit=None):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, out)
    if edit is not None:
        tensors = load_file(out / "model.safetensors")
        edit(tensors)
        save_file(tensors, out / "model.safetensors")
    if config_edit is not None:
        cfg = json.loads((out / "config.json").read_text())
        config_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_official_layout_loads(tiny_dir):
    loaded = load_v41_checkpoint(tiny_dir)
    c, t = loaded.config, loaded.tensors
    assert c.quantization["weight_block_size"] == [32, 32] and c.quantization["expert_dtype"] == "fp4"
    assert loaded.num_vision_tensors > 10  # vision tower, aligner, image span embeddings, routers' bias_vl
    assert t["layers.1.engram.embed"].dtype == torch.float8_e4m3fn  # the table stays FP8 (rows dequantised on lookup)
    assert t["layers.1.engram.embed_scale"].shape[-1] == c.engram_head_dim // 32
    assert t["layers.3.self_attn.q_a_proj.weight"].dtype == torch.float32
    assert t["mtp.0.main_proj.weight"].shape == (c.hidden_size, 3 * c.hidden_size)  # DSpark stage tensors
    assert t["mtp.1.mlp.experts.gate_up_proj"].shape[0] == c.dspark_n_routed_experts
    assert "layers.3.self_attn.indexer.q_b_proj.weight" not in t  # a Reuse layer has no indexer
    assert t["engram_hash.token_map"].max() < c.engram_compressed_vocab_size


@pytest.mark.parametrize("edit, message", [
    (lambda t: [t.pop("layers.5.attn.wo_b.weight"), t.pop("layers.5.attn.wo_b.scale")],
     "missing tensor 'layers.5.self_attn.o_b_proj.weight'"),
    (lambda t: t.pop("layers.5.attn.wo_b.weight"), "'layers.5.attn.wo_b.scale' .* is a block scale without its weight"),
    (lambda t: t.pop("layers.5.attn.wo_b.scale"), "stored as F8_E4M3 but has no .scale"),
    (lambda t: [t.pop("mtp.0.ffn.experts.1.w3.weight"), t.pop("mtp.0.ffn.experts.1.w3.scale")], "missing expert 1 up of 'mtp.0.mlp.experts.gate_up_proj'"),
    (lambda t: t.update({"layers.3.attn.compressor.wkv.weight": torch.zeros(4, 4)}),
     "unexpected tensor 'layers.3.attn.compressor.wkv.weight'"),
    (lambda t: t.update({"layers.2.attn.attn_sink": torch.zeros(7)}), "has shape \\(7,\\), the model expects \\(4,\\)"),
    (lambda t: t.update({"model.embed.weight": t.pop("embed.weight")}), "'model.' prefix"),
])
def test_broken_checkpoints_fail_with_one_line(tiny_dir, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        load_v41_checkpoint(_copy(tiny_dir, tmp_path, edit=edit))


def test_tokenizer_must_match_the_compressed_vocabulary(tiny_dir, tmp_path):
    def grow(cfg):
        cfg["text_config"]["engram_compressed_vocab_size"] += 1

    n = V41Config.from_dir(tiny_dir).engram_compressed_vocab_size
    with pytest.raises(CheckpointError, match=f"normalises to {n} compressed tokens but config .* is {n + 1}"):
        load_v41_checkpoint(_copy(tiny_dir, tmp_path, config_edit=grow))
    broken = _copy(tiny_dir, tmp_path / "x")
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        load_v41_checkpoint(broken)


def test_layout_invariants_are_checked_at_load(tiny_dir, tmp_path):
    def bad(cfg):
        cfg["text_config"]["kv_source_layer_ids"] = [2, 4, 8]

    with pytest.raises(CheckpointError, match="layer 6 has ratio 1 but reads kv source 4 of ratio 2"):
        load_v41_checkpoint(_copy(tiny_dir, tmp_path, config_edit=bad))


def test_make_tiny_model_cli(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert cli.main(["make-tiny-model", str(out), "--arch", "deepseek_v41", "--seed", "3"]) == 0
    cfg = V41Config.from_dir(out)
    assert {r.name for r in cfg.roles} == {"window", "full", "reuse", "reindex"}
    assert cfg.ced_source == 6 and cfg.candidate_source_layer_id == 6 and cfg.engram_layer_ids == (1, 4)
    assert cfg.num_stages == 2 and cfg.quantization is not None and cfg.vision is not None
    assert "every" not in capsys.readouterr().err
    assert cli.main(["make-tiny-model", str(tmp_path / "x"), "--arch", "deepseek_v41", "--fp8"]) == 2
    assert "--fp8 applies to --arch deepseek_v4" in capsys.readouterr().err
