"""A tiny, deterministic DeepSeek-V4.1 checkpoint in the official layout, every layer role present.

    layer  0  1   2     3     4          5     6               7     8        9
    role   W  W+E Full  Reuse Full+E     Reuse Full (CED)      Reuse Reindex  Reuse
    ratio  0  0   2     2     2          2     1               1     1        1

W window only, E Engram; layers 2-5 are the "encoder" (ratio 2, kv sources 2 and 4), 6-9 the
"decoder" (ratio 1, kv source 6 projects its one-row-per-token cache from layer 5's output);
layer 6 publishes the candidate pool that layer 8 scores inside; layers 2, 4, 6, 8 index. Two
DSpark stages (``mtp.0``, ``mtp.1``) read layers 7-9; a two-layer vision tower (ViT of width 32,
patch 14, 3x3 aligner, at most 64 image tokens per image) and the routers' image biases are
stored as the official checkpoint has them. Weights are stored as DeepSeek
ships them (FP8 E4M3 linears with [32, 32] UE8M0 block scales, MXFP4 experts, FP8 Engram
tables) unless ``quantize=False``. The tokenizer is the tiny byte-level BPE with ``vocab_size -
16`` tokens plus the image placeholder ``<｜deepseek_image｜>`` as a special token at the first
padding id (the config's ``image_token_id``; the other 15 ids are padding); Engram's normalised
vocabulary is counted from it. Same seed, same bytes.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from deepinfer.engine.models.deepseek_v4.rope_config import RopeConfig
from deepinfer.engine.models.deepseek_v41 import checkpoint_names as names
from deepinfer.engine.models.deepseek_v41.checkpoint_writer import save_v41_checkpoint
from deepinfer.engine.models.deepseek_v41.config import V41Config
from deepinfer.engine.models.deepseek_v41.engram import compressed_token_map, hash_primes
from deepinfer.engine.text.markup import IMAGE
from deepinfer.engine.text.tiny_tokenizer import build_tokenizer, write_tokenizer_files

PADDED_IDS = 16
STORED_FP32 = re.compile(r"(attn_hc|ffn_hc)\.(fn|base|scale)$|\.sinks$|\.e_score_correction_bias$|\.bias_vl$")
LAYOUT = dict(
    compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1),
    stage_compress_ratios=(0, 0),
    kv_source_layer_ids=(2, 4, 6),
    index_source_layer_ids=(2, 4, 6, 8),
    candidate_source_layer_id=6,
    engram_layer_ids=(1, 4),
    dspark_target_layer_ids=(7, 8, 9),
)
# make-tiny-model's default sizes (about 9M parameters)
DEFAULT_SIZES = dict(
    vocab_size=4096, hidden_size=128, moe_intermediate_size=64, num_attention_heads=4, head_dim=64,
    qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=2, n_routed_experts=16, num_experts_per_tok=4,
    sliding_window=128, index_n_heads=16, index_head_dim=32, index_topk=16, candidate_topk_blocks=4,
    candidate_block_size=8, engram_n_heads=2, engram_head_dim=32, engram_vocab_size=1000, dspark_markov_rank=32,
    dspark_n_routed_experts=8, dspark_num_experts_per_tok=2, max_position_embeddings=16384,
)
# the test suite's sizes: every role, small enough for seconds per test on 2 cores
TEST_SIZES = dict(
    DEFAULT_SIZES, vocab_size=512, hidden_size=64, moe_intermediate_size=32, head_dim=32, qk_rope_head_dim=8,
    q_lora_rank=32, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, sliding_window=16, index_topk=4,
    candidate_topk_blocks=3, candidate_block_size=4, engram_vocab_size=101, dspark_markov_rank=16,
    dspark_n_routed_experts=4, max_position_embeddings=4096,
)
TINY_VISION = {"model_type": "deepseek_v41_vision", "num_hidden_layers": 2, "hidden_size": 32,
               "num_attention_heads": 2, "intermediate_size": 64, "patch_size": 14, "rope_theta": 10000.0,
               "downsample_ratio": 3, "max_image_tokens": 64, "min_pixels": 3136, "max_wh_ratio": None}


def tiny_v41_config(compressed_vocab_size: int, **sizes) -> V41Config:
    s = {**DEFAULT_SIZES, **sizes}
    vocab = s["vocab_size"]
    primes = hash_primes(len(LAYOUT["engram_layer_ids"]), 4, s["engram_n_heads"], s["engram_vocab_size"])
    cfg = V41Config(
        **LAYOUT, **{k: v for k, v in s.items()},
        num_hidden_layers=len(LAYOUT["compress_ratios"]),
        num_nextn_predict_layers=len(LAYOUT["stage_compress_ratios"]),
        engram_num_embeddings=tuple(sum(p) for p in primes),
        engram_max_ngram_size=4,
        engram_pad_token_id=2,
        engram_compressed_vocab_size=compressed_vocab_size,
        dspark_block_size=5,
        dspark_noise_token_id=vocab - PADDED_IDS + 1,
        image_token_id=vocab - PADDED_IDS,
        rope_main=RopeConfig(theta=10000.0),
        rope_compress=RopeConfig(theta=160000.0, rope_type="yarn", factor=4.0,
                                 original_max_position_embeddings=s["max_position_embeddings"] // 4),
        bos_token_id=0, eos_token_id=(1,), pad_token_id=2,
        vision=dict(TINY_VISION),
        checkpoint_dtype="bfloat16",
    )
    cfg.validate()
    return cfg


def init_weights(cfg: V41Config, seed: int) -> dict[str, torch.Tensor]:
    """Random canonical tensors (float32) that keep every path busy: O(1) activations, non-zero
    sinks, biases and mHC weights."""
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in names.canonical_shapes(cfg).items():
        if name in (names.TOKEN_MAP,) or name.endswith(".engram.embed_scale"):
            continue
        noise = torch.randn(shape, generator=g)
        if name.endswith(("norm.weight", ".scale", "q_weight", "k_weight")):
            t = 1.0 + 0.1 * noise
        elif name.endswith(".sinks"):
            t = noise
        elif name.endswith((".base", "e_score_correction_bias", ".bias_vl")):
            t = 0.2 * noise
        elif name.endswith(".engram.embed") or name == "embed_tokens.weight":
            t = noise
        elif len(shape) >= 2:
            t = noise / math.sqrt(shape[-1])
        else:
            raise AssertionError(f"no init rule for {name}")
        tensors[name] = t.contiguous()
    return tensors


def vision_tensors(cfg: V41Config, seed: int) -> dict[str, torch.Tensor]:
    """The vision tower, aligner and image span embeddings (bfloat16) under their official names,
    and the DSpark stages' image biases (float32; the backbone's are the text model's)."""
    v = cfg.vision
    vd, inter, p, d = v["hidden_size"], v["intermediate_size"], v["patch_size"], cfg.hidden_size
    k = v["downsample_ratio"] ** 2 * vd
    shapes = {"vision.patch_embed.proj.weight": (vd, 3 * p * p), "vision.patch_embed.proj.bias": (vd,),
              "vision.norm.weight": (vd,), "aligner.w1.weight": (d, k), "aligner.w1.bias": (d,),
              "aligner.w2.weight": (d, d), "aligner.w2.bias": (d,),
              "image_start": (d,), "image_end": (d,), "image_newline": (d,)}
    for b in range(v["num_hidden_layers"]):
        x = f"vision.blocks.{b}."
        shapes.update({x + "norm1.weight": (vd,), x + "norm2.weight": (vd,), x + "attn.wqkv.weight": (3 * vd, vd),
                       x + "attn.wqkv.bias": (3 * vd,), x + "attn.wo.weight": (vd, vd), x + "attn.wo.bias": (vd,),
                       x + "mlp.w1.weight": (2 * inter, vd), x + "mlp.w2.weight": (vd, inter)})
    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=g)
        if name.endswith("norm.weight") or ".norm" in name:
            t = 1.0 + 0.1 * noise
        elif name.startswith("image_"):
            t = noise  # O(1), like the token embeddings they stand beside
        elif name.endswith(".bias"):
            t = 0.02 * noise
        else:
            t = noise / math.sqrt(shape[-1])
        out[name] = t.to(torch.bfloat16)
    for stage in range(cfg.num_stages):
        out[f"mtp.{stage}.ffn.gate.bias_vl"] = 0.2 * torch.randn(cfg.dspark_n_routed_experts, generator=g)
    return out


def write_tiny_v41(out_dir: str | Path, seed: int = 0, *, quantize: bool = True, **sizes) -> V41Config:
    """config.json, model.safetensors, tokenizer.json and tokenizer_config.json in ``out_dir``."""
    sizes = {**DEFAULT_SIZES, **sizes}
    tokenizer = build_tokenizer(sizes["vocab_size"] - PADDED_IDS)
    tokenizer.add_special_tokens([IMAGE])  # id vocab_size - PADDED_IDS: the config's image_token_id
    _, compressed = compressed_token_map(tokenizer, sizes["vocab_size"])
    cfg = tiny_v41_config(compressed, **sizes)
    assert tokenizer.token_to_id(IMAGE) == cfg.image_token_id, "the image placeholder must be the image token"
    tensors = init_weights(cfg, seed)
    if quantize:  # bfloat16 as released, except the mHC weights, sinks and router biases (float32)
        tensors = {k: t if STORED_FP32.search(k) else t.to(torch.bfloat16) for k, t in tensors.items()}
    written = save_v41_checkpoint(out_dir, cfg, tensors, quantize=quantize, extra=vision_tensors(cfg, seed))
    write_tokenizer_files(out_dir, tokenizer, model_max_length=cfg.max_position_embeddings)
    return written
