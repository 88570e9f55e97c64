"""ModelConfig parsing: transformers' names, DeepSeek's released names, DeepSeek's inference names."""

import json

import pytest

from deepinfer.engine.models.deepseek_v4.config import (
    CSA,
    HASH_MOE,
    HCA,
    MOE,
    SLIDING,
    ModelConfig,
    ModelConfigError,
    RopeConfig,
)

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config  # noqa: E402

# The shape of DeepSeek-V4-Flash's released config.json (native spellings), shortened to 6 layers.
RELEASED_STYLE = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 6,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 0],  # one extra entry for the MTP layer
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "expert_dtype": "fp4",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}


def assert_matches_transformers(cfg: ModelConfig, hf: DeepseekV4Config):
    """Every fact the engine reads agrees with transformers' reading of the same config."""
    assert cfg.layer_types == tuple(hf.layer_types)
    assert cfg.mlp_layer_types == tuple(hf.mlp_layer_types)
    assert cfg.compress_rates == dict(hf.compress_rates)
    assert cfg.qk_rope_head_dim == hf.qk_rope_head_dim
    for ours, theirs in ((cfg.rope_main, hf.rope_parameters["main"]), (cfg.rope_compress, hf.rope_parameters["compress"])):
        assert ours.theta == theirs["rope_theta"]
        assert ours.rope_type == theirs["rope_type"]
        if ours.rope_type == "yarn":
            assert ours.factor == theirs["factor"]
            assert ours.original_max_position_embeddings == theirs["original_max_position_embeddings"]
            assert ours.attention_factor == theirs["attention_factor"]
            assert (ours.beta_fast, ours.beta_slow) == (theirs.get("beta_fast", 32), theirs.get("beta_slow", 1))
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                 "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                 "hc_mult", "hc_sinkhorn_iters", "hc_eps", "n_routed_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "scoring_func", "routed_scaling_factor", "swiglu_limit", "rms_norm_eps",
                 "max_position_embeddings", "tie_word_embeddings", "bos_token_id"):
        assert getattr(cfg, name) == getattr(hf, name), name


def test_released_style_config_reads_like_transformers():
    cfg = ModelConfig.from_dict(RELEASED_STYLE)
    assert cfg.layer_types == (SLIDING, SLIDING, CSA, HCA, CSA, HCA)
    assert cfg.compress_ratios == (0, 0, 4, 128, 4, 128)
    assert cfg.mlp_layer_types == (HASH_MOE,) * 3 + (MOE,) * 3
    assert cfg.rope_main == RopeConfig(theta=10000.0)
    assert cfg.rope_compress == RopeConfig(
        theta=160000.0, rope_type="yarn", factor=16.0, original_max_position_embeddings=65536, attention_factor=1.0
    )
    assert cfg.quantization["expert_dtype"] == "fp4" and cfg.quantization["scale_fmt"] == "ue8m0"
    assert cfg.checkpoint_dtype == "bfloat16"
    raw = dict(RELEASED_STYLE)
    raw.pop("quantization_config")  # transformers would try to build an FP8 quantizer
    assert_matches_transformers(cfg, DeepseekV4Config(**raw))


def test_transformers_spelling_round_trips_through_transformers():
    hf = DeepseekV4Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, head_dim=32, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        sliding_window=8, index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2,
        compress_rates={CSA: 2, HCA: 8}, layer_types=[SLIDING, CSA, HCA, CSA, SLIDING],
        mlp_layer_types=[HASH_MOE, MOE, HASH_MOE, MOE, MOE], partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        max_position_embeddings=1024, eos_token_id=[1, 2],
    )
    cfg = ModelConfig.from_dict(hf.to_dict())
    assert_matches_transformers(cfg, hf)
    assert cfg.compress_ratios == (0, 2, 8, 2, 0)
    assert cfg.eos_token_id == (1, 2)
    # our writer's output reads back identically, in our parser and in transformers'
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg
    assert_matches_transformers(cfg, DeepseekV4Config(**cfg.to_hf_dict()))
    json.dumps(cfg.to_hf_dict())  # plain JSON


def test_native_spelling_round_trips():
    cfg = ModelConfig.from_dict(RELEASED_STYLE)
    native = cfg.to_native_dict()
    assert native["compress_ratios"] == [0, 0, 4, 128, 4, 128] and native["num_hash_layers"] == 3
    assert native["expert_dtype"] == "fp4" and "expert_dtype" not in native["quantization_config"]
    assert ModelConfig.from_dict(native) == cfg
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg


def test_deepseek_inference_field_names():
    """The ModelArgs spelling of DeepSeek's reference inference code (no model_type at all)."""
    cfg = ModelConfig.from_dict({
        "vocab_size": 1000, "dim": 128, "moe_inter_dim": 64, "n_layers": 4, "n_hash_layers": 1, "n_mtp_layers": 1,
        "n_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "n_activated_experts": 2,
        "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 32, "head_dim": 64,
        "rope_head_dim": 16, "norm_eps": 1e-6, "o_groups": 2, "o_lora_rank": 32, "window_size": 16,
        "compress_ratios": [0, 4, 32, 4, 0], "compress_rope_theta": 160000.0, "original_seq_len": 2048,
        "rope_theta": 10000.0, "rope_factor": 4, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 2,
        "index_head_dim": 32, "index_topk": 8, "hc_mult": 2, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "dtype": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4",
    })
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (128, 4, 4)
    assert (cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.qk_rope_head_dim) == (64, 2, 16)
    assert (cfg.sliding_window, cfg.num_nextn_predict_layers, cfg.routed_scaling_factor) == (16, 1, 1.5)
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA) and cfg.compress_rates == {CSA: 4, HCA: 32}
    assert cfg.mlp_layer_types == (HASH_MOE, MOE, MOE, MOE)
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.factor == 4.0
    assert cfg.rope_compress.original_max_position_embeddings == 2048
    assert cfg.max_position_embeddings == 8192
    assert cfg.quantization["expert_dtype"] == "fp4" and cfg.checkpoint_dtype == "bfloat16"


def test_nested_yarn_without_attention_factor_derives_it_like_transformers():
    raw = {"model_type": "deepseek_v4", "num_hidden_layers": 2, "compress_rates": {CSA: 4, HCA: 8},
           "layer_types": [CSA, HCA], "rope_parameters": {
               "main": {"rope_type": "default", "rope_theta": 10000.0},
               "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                            "original_max_position_embeddings": 4096}}}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_compress.attention_factor == pytest.approx(0.1 * __import__("math").log(16.0) + 1.0)


def test_from_dir_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_STYLE))
    assert ModelConfig.from_dir(tmp_path) == ModelConfig.from_dict(RELEASED_STYLE)


@pytest.mark.parametrize(
    "patch, words",
    [
        ({"model_type": "llama"}, ["llama", "supported: deepseek_v4"]),
        ({"model_type": None, "compress_ratios": None}, ["no model_type", "deepseek_v4"]),
        ({"hidden_size": -3}, ["hidden_size", ">= 1"]),
        ({"hidden_size": "big"}, ["hidden_size", "integer"]),
        ({"num_key_value_heads": 4}, ["num_key_value_heads"]),
        ({"compress_ratios": [0, 4]}, ["compress_ratios", "2 entries"]),
        ({"compress_ratios": [0, 4, 128, 64, 4, 0]}, ["compress_ratios", "HCA ratios"]),
        ({"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}, ["layer_types[5]", "full_attention"]),
        ({"mlp_layer_types": ["moe"] * 3}, ["mlp_layer_types", "3 entries"]),
        ({"scoring_func": "relu"}, ["scoring_func", "relu"]),
        ({"o_groups": 7}, ["o_groups"]),
        ({"qk_rope_head_dim": 63}, ["qk_rope_head_dim"]),
        ({"num_experts_per_tok": 300}, ["num_experts_per_tok"]),
        ({"eos_token_id": 999999}, ["eos_token_id", "vocabulary"]),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["rope_scaling.rope_type", "dynamic"]),
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, ["rope_scaling.original_max_position_embeddings"]),
        ({"quantization_config": {"quant_method": "awq"}}, ["quantization_config.quant_method", "awq"]),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, ["weight_block_size"]),
        ({"expert_dtype": "fp2"}, ["expert_dtype", "fp2"]),
    ],
)
def test_bad_fields_fail_with_one_line_naming_the_field(patch, words):
    raw = {**RELEASED_STYLE, **patch}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ModelConfigError) as info:
        ModelConfig.from_dict(raw)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_missing_or_broken_config_json(tmp_path):
    with pytest.raises(ModelConfigError, match="has no config.json"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ModelConfigError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


def test_native_writer_refuses_what_native_cannot_express():
    cfg = ModelConfig.from_dict({**RELEASED_STYLE, "compress_ratios": None, "compress_rates": {CSA: 2, HCA: 8},
                                 "layer_types": [SLIDING, CSA, HCA, CSA, HCA, SLIDING]})
    with pytest.raises(ModelConfigError, match="compress_rates"):
        cfg.to_native_dict()
