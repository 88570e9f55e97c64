"""A tiny, deterministic DeepSeek-V4 checkpoint for tests, benchmarks and ``deepinfer serve``.

Default (about 17M parameters, fast on 2 CPU cores): vocab 4096, hidden 256, 8 layers
``WWCHCHCH`` (two window-only layers, then CSA and HCA alternating), 16 experts top-4 with the
first 2 layers hash-routed, window 128, hc_mult 4, 8 heads of 64 (16 of them rotary), context
16384 with YaRN on the compressed layers. Every layer kind and both routings are present.

Weights are drawn from one seeded generator in canonical-name order (std 0.02 for matrices,
non-zero sinks, position biases and router biases, a random ``tid2eid`` of distinct experts),
stored in bfloat16 with the precision-critical tensors in float32, as DeepSeek ships them.
Same seed -> byte-identical files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.engine.loader.checkpoint_writer import Layout, save_checkpoint
from deepinfer.engine.models.deepseek_v4.checkpoint_names import canonical_shapes, is_fp32_param
from deepinfer.engine.models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig
from deepinfer.engine.models.deepseek_v4.rope_config import RopeConfig
from deepinfer.engine.text.tiny_tokenizer import build_tokenizer, write_tokenizer_files

DEFAULT_LAYERS = "WWCHCHCH"
DEFAULT_HASH_LAYERS = 2
_LETTER2KIND = {"W": SLIDING, "C": CSA, "H": HCA}
_RATIO2KIND = {0: SLIDING, 4: CSA, 128: HCA}


class TinyModelError(ValueError):
    """A bad make-tiny-model option; the message names it."""


def parse_layers(spec: str) -> tuple[str, ...]:
    """Attention kind per layer from letters (``WWCHCHCH``: W window-only, C CSA, H HCA) or
    DeepSeek's compress ratios (``0,0,4,128``)."""
    spec = spec.strip()
    if not spec:
        raise TinyModelError("--layers is empty; give letters like WWCH or ratios like 0,0,4,128")
    if "," in spec or spec.isdigit():
        try:
            ratios = [int(x) for x in spec.split(",")]
        except ValueError:
            raise TinyModelError(f"--layers {spec!r}: ratios must be integers from 0, 4, 128") from None
        bad = [r for r in ratios if r not in _RATIO2KIND]
        if bad:
            raise TinyModelError(f"--layers {spec!r}: ratio {bad[0]} is not one of 0, 4, 128")
        return tuple(_RATIO2KIND[r] for r in ratios)
    bad = [c for c in spec.upper() if c not in _LETTER2KIND]
    if bad:
        raise TinyModelError(f"--layers {spec!r}: letter {bad[0]!r} is not W (window), C (CSA) or H (HCA)")
    return tuple(_LETTER2KIND[c] for c in spec.upper())


def tiny_config(layers: str = DEFAULT_LAYERS, num_hash_layers: int = DEFAULT_HASH_LAYERS) -> ModelConfig:
    layer_types = parse_layers(layers)
    n = len(layer_types)
    if not 0 <= num_hash_layers <= n:
        raise TinyModelError(f"--hash-layers {num_hash_layers} must be between 0 and the layer count {n}")
    cfg = ModelConfig(
        model_type="deepseek_v4",
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=n,
        num_attention_heads=8,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=64,
        sliding_window=128,
        layer_types=layer_types,
        compress_rates={CSA: 4, HCA: 128},
        index_n_heads=4,
        index_head_dim=32,
        index_topk=64,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        mlp_layer_types=(HASH_MOE,) * num_hash_layers + (MOE,) * (n - num_hash_layers),
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        max_position_embeddings=16384,
        rope_main=RopeConfig(theta=10000.0),
        rope_compress=RopeConfig(theta=160000.0, rope_type="yarn", factor=4.0,
                                 original_max_position_embeddings=4096, attention_factor=1.0),
        num_nextn_predict_layers=0,
        bos_token_id=0,
        eos_token_id=(1,),
        pad_token_id=2,
        checkpoint_dtype="bfloat16",
    )
    cfg.validate()
    return cfg


def init_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random canonical tensors (float32, tid2eid int64), deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in canonical_shapes(cfg).items():
        if name.endswith(".tid2eid"):
            # each token's hash experts: the first top_k of a random permutation (distinct experts)
            order = torch.rand(shape[0], cfg.n_routed_experts, generator=g).argsort(dim=1)
            tensors[name] = order[:, : shape[1]].to(torch.int64).contiguous()
            continue
        noise = torch.randn(shape, generator=g)
        if name.endswith((".weight", ".fn", ".hc_fn", ".gate_up_proj", ".down_proj")) and len(shape) >= 2:
            t = noise * 0.02
        elif name.endswith("norm.weight") or name.endswith((".scale", ".hc_scale")):
            t = 1.0 + 0.1 * noise  # RMSNorm gains and mHC scales around 1
        elif name.endswith(".sinks"):
            t = 0.5 * noise
        elif name.endswith(("position_bias", ".base", ".hc_base")):
            t = 0.1 * noise
        elif name.endswith("e_score_correction_bias"):
            t = 0.01 * noise
        else:
            raise AssertionError(f"no init rule for {name}")
        tensors[name] = t.contiguous()
    return tensors


def write_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    layers: str = DEFAULT_LAYERS,
    num_hash_layers: int = DEFAULT_HASH_LAYERS,
    native: bool = False,
    fp8: bool = False,
) -> ModelConfig:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json to ``out_dir``."""
    cfg = tiny_config(layers, num_hash_layers)
    tensors = {
        name: t if is_fp32_param(name) or not t.is_floating_point() else t.to(torch.bfloat16)
        for name, t in init_weights(cfg, seed).items()
    }
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise TinyModelError(f"output path {str(out)!r} exists and is not a directory")
    written = save_checkpoint(out, cfg, tensors, Layout(native=native, quantize=fp8, expert_dtype="fp4"))
    tokenizer = build_tokenizer(cfg.vocab_size)
    assert tokenizer.get_vocab_size() <= cfg.vocab_size
    write_tokenizer_files(out, tokenizer, model_max_length=cfg.max_position_embeddings)
    return written
