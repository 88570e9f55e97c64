"""Checkpoint loading: the same weights in every layout load to transformers' state_dict."""

import json
import struct

import pytest
import torch

from deepinfer.engine.loader.checkpoint_writer import Layout, save_checkpoint
from deepinfer.engine.loader.weights import load_checkpoint
from deepinfer.engine.models.deepseek_v4.checkpoint_names import canonical_shapes, is_fp32_param
from deepinfer.engine.models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

# HCA ratio 128: transformers maps DeepSeek's native compress_ratios only for 0/4/128.
TINY = dict(
    vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4, o_groups=2, o_lora_rank=16,
    index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8, partial_rotary_factor=0.25,
    compress_rates={CSA: 4, HCA: 128}, layer_types=[SLIDING, CSA, HCA, CSA],
    mlp_layer_types=[HASH_MOE, HASH_MOE, MOE, MOE],
)


def canonical_state_dict(model) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**TINY)).eval()
    with torch.no_grad():  # transformers zero-initialises these; make every tensor distinctive
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
            if name.endswith("tid2eid"):
                b.copy_(torch.rand(b.shape[0], TINY["n_routed_experts"]).argsort(dim=1)[:, : b.shape[1]])
    return model


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf_model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(hf_model):
    return canonical_state_dict(hf_model)


def header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def assert_same_tensors(loaded: dict, reference: dict):
    assert sorted(loaded) == sorted(reference)
    for name, ref in reference.items():
        assert loaded[name].shape == ref.shape, name
        assert loaded[name].dtype == ref.dtype, name
        assert torch.equal(loaded[name], ref), name


@pytest.mark.parametrize("hc_mult, layer_types, hash_layers", [
    (1, [SLIDING, CSA, HCA, CSA], 1), (2, [HCA, HCA, HCA, CSA], 0), (4, [SLIDING] * 4, 4),
])
def test_canonical_shapes_match_transformers_state_dict(hc_mult, layer_types, hash_layers):
    hf_cfg = DeepseekV4Config(**{**TINY, "hc_mult": hc_mult, "layer_types": layer_types,
                                 "mlp_layer_types": [HASH_MOE] * hash_layers + [MOE] * (4 - hash_layers)})
    shapes = {k: tuple(v.shape) for k, v in canonical_state_dict(DeepseekV4ForCausalLM(hf_cfg)).items()}
    ours = canonical_shapes(ModelConfig.from_dict(hf_cfg.to_dict()))
    assert list(ours.items()) == list(shapes.items())


def test_save_pretrained_directory_loads_to_the_hf_state_dict(hf_dir, reference):
    cfg, tensors = load_checkpoint(hf_dir, torch.float32, progress=False)
    assert cfg.layer_types == tuple(TINY["layer_types"]) and cfg.hidden_size == 64
    assert_same_tensors(tensors, reference)
    assert tensors["layers.0.mlp.gate.tid2eid"].dtype == torch.int64


@pytest.mark.parametrize("layout", [
    Layout(native=True),
    Layout(native=False),
    Layout(native=False, max_shard_bytes=40_000),
    Layout(native=True, max_shard_bytes=40_000),
], ids=["native", "prefixed", "sharded", "native-sharded"])
def test_every_unquantised_layout_loads_identically(layout, reference, tmp_path):
    cfg = ModelConfig.from_dict(TINY | {"model_type": "deepseek_v4"})
    save_checkpoint(tmp_path, cfg, reference, layout)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 if layout.max_shard_bytes else files == ["model.safetensors"]
    keys = set().union(*(header(tmp_path / f) for f in files)) - {"__metadata__"}
    if layout.native:
        assert "layers.1.attn.wq_a.weight" in keys and "layers.0.ffn.experts.3.w3.weight" in keys
        assert "embed.weight" in keys and "head.weight" in keys and "hc_head_fn" in keys
        assert json.loads((tmp_path / "config.json").read_text())["compress_ratios"] == [0, 4, 128, 4]
    else:
        assert "model.layers.1.self_attn.q_a_proj.weight" in keys and "lm_head.weight" in keys
    loaded_cfg, tensors = load_checkpoint(tmp_path, torch.float32, progress=False)
    assert loaded_cfg == cfg
    assert_same_tensors(tensors, reference)


def test_transformers_reads_our_native_layout_to_the_same_weights(reference, tmp_path):
    """transformers' own DeepSeek rename rules agree with our native names."""
    cfg = ModelConfig.from_dict(TINY | {"model_type": "deepseek_v4"})
    save_checkpoint(tmp_path, cfg, reference, Layout(native=True))
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_tensors(canonical_state_dict(model), reference)


def test_unprefixed_names_and_mtp_tensors(reference, tmp_path):
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in reference.items()}
    tensors["mtp.0.attn.wq_a.weight"] = torch.ones(3, 3)  # MTP layers are skipped for now
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY | {"model_type": "deepseek_v4"}))
    _, loaded = load_checkpoint(tmp_path, torch.float32, progress=False)
    assert_same_tensors(loaded, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "bf16"])
def test_bfloat16_keeps_precision_critical_tensors_in_float32(hf_dir, reference, dtype):
    _, tensors = load_checkpoint(hf_dir, dtype, progress=False)
    for name, t in tensors.items():
        if name.endswith("tid2eid"):
            assert t.dtype == torch.int64 and torch.equal(t, reference[name])
        elif is_fp32_param(name):
            assert t.dtype == torch.float32 and torch.equal(t, reference[name]), name
        else:
            assert t.dtype == torch.bfloat16 and torch.equal(t, reference[name].to(torch.bfloat16)), name
    assert tensors["layers.0.attn_hc.fn"].dtype == torch.float32
    assert tensors["layers.1.self_attn.q_a_proj.weight"].dtype == torch.bfloat16


def test_expected_shapes_from_the_model_are_used(hf_dir, hf_model):
    expected = {k: tuple(v.shape) for k, v in canonical_state_dict(hf_model).items()}
    _, tensors = load_checkpoint(hf_dir, torch.float32, expected=expected, progress=False)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected


def test_tied_embeddings_fill_lm_head(reference, tmp_path):
    cfg = ModelConfig.from_dict(TINY | {"model_type": "deepseek_v4", "tie_word_embeddings": True})
    save_checkpoint(tmp_path, cfg, reference, Layout())
    assert "lm_head.weight" not in header(tmp_path / "model.safetensors")
    _, tensors = load_checkpoint(tmp_path, torch.float32, progress=False)
    assert torch.equal(tensors["lm_head.weight"], reference["embed_tokens.weight"])


def test_progress_bar_is_shown(hf_dir, capfd):
    load_checkpoint(hf_dir, torch.float32, progress=True)
    err = capfd.readouterr().err
    assert "Loading" in err and "tensor" in err
