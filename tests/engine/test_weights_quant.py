"""Quantised checkpoints: FP8 block-scaled linears and packed MXFP4 experts dequantise correctly."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.engine.loader.checkpoint_writer import Layout, save_checkpoint
from deepinfer.engine.loader.dequant import dequant_fp4, quantize_fp4, quantize_fp8
from deepinfer.engine.loader.weights import load_checkpoint
from deepinfer.engine.models.deepseek_v4.checkpoint_names import is_expert_tensor, is_fp8_linear
from deepinfer.engine.models.deepseek_v4.tiny_model import init_weights, tiny_config

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(scope="module")
def cfg():
    # 128-row/column blocks do not divide every matrix here: partial edge blocks get tested too.
    return tiny_config("WCH", num_hash_layers=1)


@pytest.fixture(scope="module")
def weights(cfg):
    return init_weights(cfg, seed=3)


def header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("native", [True, False], ids=["native-scale", "weight_scale_inv"])
def test_fp8_linears_dequantise_within_fp8_tolerance(cfg, weights, native, tmp_path):
    save_checkpoint(tmp_path, cfg, weights, Layout(native=native, quantize=True, expert_dtype="none"))
    stored = header(tmp_path / "model.safetensors")
    scale_name = "layers.1.attn.wq_a.scale" if native else "model.layers.1.self_attn.q_a_proj.weight_scale_inv"
    weight_name = "layers.1.attn.wq_a.weight" if native else "model.layers.1.self_attn.q_a_proj.weight"
    assert stored[weight_name]["dtype"] == "F8_E4M3" and stored[scale_name]["dtype"] == "F8_E8M0"
    loaded_cfg, tensors = load_checkpoint(tmp_path, torch.float32, progress=False)
    assert loaded_cfg.quantization["scale_fmt"] == "ue8m0"
    num_fp8 = 0
    for name, ref in weights.items():
        if is_fp8_linear(name):
            num_fp8 += 1
            # e4m3 keeps 3 mantissa bits: each normal value is within 2^-4 relative
            assert relative_error(tensors[name], ref) < 2 ** -4, name
            assert not torch.equal(tensors[name], ref)  # it really went through FP8
        else:
            assert torch.equal(tensors[name], ref), name
    assert num_fp8 == 3 * 4 + 1 + 3 * 3  # q_a, q_b, kv, o_b per layer + the CSA indexer's q_b + shared experts


def test_fp8_with_float32_scales_in_transformers_naming(cfg, weights, tmp_path):
    save_checkpoint(tmp_path, cfg, weights, Layout())
    name = "layers.0.self_attn.q_b_proj.weight"
    q, scale = quantize_fp8(weights[name], (128, 128), scale_fmt="float")
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "model.safetensors")
    stored["model." + name] = q
    stored["model." + name.replace(".weight", ".weight_scale_inv")] = scale
    save_file(stored, str(tmp_path / "model.safetensors"))
    _, tensors = load_checkpoint(tmp_path, torch.float32, progress=False)
    expected = q.float() * scale.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]
    assert torch.equal(tensors[name], expected)
    assert relative_error(tensors[name], weights[name]) < 2 ** -4


@pytest.mark.parametrize("storage", ["int8", "float4_e2m1fn_x2"])
def test_fp4_experts_dequantise_exactly_to_the_e2m1_grid(cfg, weights, storage, tmp_path):
    """Random packed codes and scales, written per expert in native names, load to code * 2^e exactly."""
    save_checkpoint(tmp_path, cfg, weights, Layout(native=True))
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    expected_gate_up = torch.empty(cfg.n_routed_experts, 2 * inter, hidden)
    for expert in range(cfg.n_routed_experts):
        for part, rows in (("w1", slice(0, inter)), ("w3", slice(inter, 2 * inter))):
            codes = torch.randint(0, 256, (inter, hidden // 2), generator=g, dtype=torch.uint8)
            exponents = torch.randint(120, 130, (inter, hidden // 32), generator=g, dtype=torch.uint8)
            key = f"layers.2.ffn.experts.{expert}.{part}"
            packed = codes.view(torch.int8) if storage == "int8" else codes.view(torch.float4_e2m1fn_x2)
            stored[key + ".weight"] = packed
            stored[key + ".scale"] = exponents.view(torch.float8_e8m0fnu)
            # independent reference: low nibble is the even element, bit 3 the sign
            values = torch.tensor([[(-1) ** (c >> 3 & 1) * E2M1[c & 7] for byte in row.tolist()
                                    for c in (byte & 15, byte >> 4)] for row in codes])
            scales = torch.tensor([[2.0 ** (e - 127) for e in row.tolist()] for row in exponents])
            expected_gate_up[expert, rows] = values * scales.repeat_interleave(32, dim=1)
    save_file(stored, str(tmp_path / "model.safetensors"))
    _, tensors = load_checkpoint(tmp_path, torch.float32, progress=False)
    assert torch.equal(tensors["layers.2.mlp.experts.gate_up_proj"], expected_gate_up)
    assert torch.equal(tensors["layers.2.mlp.experts.down_proj"], weights["layers.2.mlp.experts.down_proj"])


@pytest.mark.parametrize("native", [True, False], ids=["native", "transformers"])
def test_released_layout_fp8_linears_and_fp4_experts(cfg, weights, native, tmp_path):
    """The layout DeepSeek ships: FP8 linears, MXFP4 experts; sharded, loaded in bfloat16."""
    save_checkpoint(tmp_path, cfg, weights, Layout(native=native, quantize=True, max_shard_bytes=1 << 20))
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded_cfg, tensors = load_checkpoint(tmp_path, torch.bfloat16, progress=False)
    assert loaded_cfg.quantization["expert_dtype"] == "fp4"
    for name, ref in weights.items():
        if is_expert_tensor(name):
            # exactly what MXFP4 represents, per expert matrix
            grid = torch.stack([dequant_fp4(*quantize_fp4(m), torch.float32) for m in ref])
            assert torch.equal(tensors[name], grid.to(torch.bfloat16)), name
        elif is_fp8_linear(name):
            assert relative_error(tensors[name], ref) < 2 ** -4 + 2 ** -8, name
    assert tensors["layers.0.attn_hc.fn"].dtype == torch.float32


def test_dequant_helpers_round_trip_partial_blocks():
    w = torch.randn(300, 200) * 0.02
    q, scale = quantize_fp8(w)
    assert scale.shape == (3, 2) and scale.dtype == torch.float8_e8m0fnu
    from deepinfer.engine.loader.dequant import dequant_fp8

    assert relative_error(dequant_fp8(q, scale, (128, 128), torch.float32), w) < 2 ** -4
    # raw E8M0 bytes (uint8) mean the same scales
    assert torch.equal(dequant_fp8(q, scale.view(torch.uint8), (128, 128), torch.float32),
                       dequant_fp8(q, scale, (128, 128), torch.float32))
