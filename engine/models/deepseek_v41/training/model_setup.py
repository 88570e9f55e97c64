"""The model trained by `deepinfer train-tiny`: its config, initial weights, trainable tensors and QAT.

Layout: the tiny V4.1 layout (tiny_model.py: 10 layers with every role, 2 DSpark stages, Engram on
layers 1 and 4), at ``TRAIN_SIZES``. The config is built with ``quantization=None`` while
training (float Engram tables); the checkpoint writer stores the release's formats (FP8 E4M3
linears with [32, 32] UE8M0 block scales, MXFP4 experts, FP8 Engram rows).

Quantisation-aware training (``enable_qat``): from a chosen step on, every tensor the writer
will quantise is read in the forward as its quantise-dequantise image (the loader's own
``quantize_fp8``/``quantize_fp4`` and ``dequant_*``), with the straight-through gradient, so the
shipped FP8/FP4 weights are the ones the loss saw. ``disable_qat`` restores the plain tensors.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.nn.utils import parametrize

from deepinfer.engine.loader.dequant import dequant_fp4, dequant_fp8, quantize_fp4, quantize_fp8
from deepinfer.engine.models.deepseek_v41 import checkpoint_names as names
from deepinfer.engine.models.deepseek_v41.config import V41Config
from deepinfer.engine.models.deepseek_v41.engram import token_map_from_dir
from deepinfer.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.engine.models.deepseek_v41.tiny_model import tiny_v41_config

# about 17M parameters (10M of them routed experts; ~6M active per token); the checkpoint ~16 MB
TRAIN_SIZES = dict(
    vocab_size=4096, hidden_size=192, moe_intermediate_size=96, num_attention_heads=4, head_dim=64,
    qk_rope_head_dim=16, q_lora_rank=128, o_lora_rank=64, o_groups=2, n_routed_experts=16, num_experts_per_tok=4,
    sliding_window=128, index_n_heads=8, index_head_dim=32, index_topk=64, candidate_topk_blocks=16,
    candidate_block_size=8, engram_n_heads=4, engram_head_dim=32, engram_vocab_size=2053, dspark_markov_rank=32,
    dspark_n_routed_experts=8, dspark_num_experts_per_tok=2, max_position_embeddings=16384,
)
# a few-second CPU model with every role (tests); 16 index heads keep exact score ties (relu sums of 0,
# whose top-k order serving and the dense forward may break differently) rare
SMALL_SIZES = dict(
    TRAIN_SIZES, vocab_size=512, hidden_size=64, moe_intermediate_size=32, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32,
    o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, sliding_window=16, index_n_heads=16, index_head_dim=32,
    index_topk=4, candidate_topk_blocks=3, candidate_block_size=4, engram_n_heads=2, engram_head_dim=32,
    engram_vocab_size=101, dspark_markov_rank=16, dspark_n_routed_experts=4,
)
FP8_BLOCK, TABLE_BLOCK = (32, 32), (1, 32)
OUTPUT_PROJECTIONS = (".o_b_proj.weight", ".down_proj.weight", ".mlp.experts.down_proj")


def training_config(compressed_vocab_size: int, sizes: dict) -> V41Config:
    return dataclasses.replace(tiny_v41_config(compressed_vocab_size, **sizes), quantization=None)


def build_model(cfg: V41Config, data_dir, seed: int, device) -> DeepseekV41ForCausalLM:
    """A freshly initialised model on ``device`` with the tokenizer's Engram token map; every
    learned tensor requires grad (the router biases are steered by the trainer instead)."""
    model = DeepseekV41ForCausalLM(cfg)
    init_weights(model, seed)
    model.engram_hash.token_map.copy_(token_map_from_dir(data_dir, cfg.vocab_size, cfg.engram_compressed_vocab_size,
                                                         cfg.engram_pad_token_id))
    model.to(device)
    for p in trainable(model).values():
        p.requires_grad_(True)
    return model


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Learned tensors by canonical name: every parameter and the Engram tables."""
    out = {k: p for k, p in model.named_parameters()}
    for k, b in model.named_buffers():
        if names.ENGRAM_TABLE.search(k):
            out[k] = b
    return out


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    for name, t in state.items():
        if not t.is_floating_point() or name.endswith(".engram.embed_scale"):
            continue
        shape = t.shape
        noise = torch.randn(shape, generator=g)
        if name.endswith(("norm.weight", "q_weight", "k_weight")) or name.endswith(".scale"):
            value = torch.ones(shape)
        elif name.endswith((".sinks", "e_score_correction_bias", ".bias_vl", "confidence_head.proj.weight")):
            # bias_vl: the routers' image-token bias (vision configs); no image is seen in training
            value = torch.zeros(shape)
        elif name.endswith(".base"):
            value = _mhc_base(shape[0])
        elif name.endswith(".fn"):
            value = noise * 0.05 / math.sqrt(shape[-1])  # mixes start near 0: pre/post/comb from base
        elif name in ("embed_tokens.weight",) or names.ENGRAM_TABLE.search(name) or name.endswith("markov_head.embed.weight"):
            value = noise
        elif name.endswith("markov_head.head.weight"):
            value = noise * 0.01
        elif len(shape) >= 2:
            value = noise / math.sqrt(shape[-1])
            if name.endswith(OUTPUT_PROJECTIONS) or name == "lm_head.weight":
                value = value * 0.5
        else:
            raise AssertionError(f"no init rule for {name}")
        t.copy_(value)


def _mhc_base(width: int) -> torch.Tensor:
    """pre = post = sigmoid(0)-based, comb near the identity (before Sinkhorn)."""
    n = int(round((math.sqrt(4 + 4 * width) - 2) / 2))  # width = (2 + n) * n
    base = torch.zeros(width)
    base[2 * n :] = (3.0 * torch.eye(n)).reshape(-1)
    return base


# ---- quantisation-aware training ------------------------------------------------------------
class _FakeQuant(nn.Module):
    """Straight-through quantise-dequantise in the checkpoint's format."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.kind == "fp4":
                flat = w.detach().float().reshape(-1, w.shape[-1])
                q = dequant_fp4(*quantize_fp4(flat), torch.float32).view(w.shape)
            else:
                block = TABLE_BLOCK if self.kind == "table" else FP8_BLOCK
                q = dequant_fp8(*quantize_fp8(w.detach().float(), block), block, torch.float32)
        return w + (q.to(w.dtype) - w).detach()


def quantised_tensors(model: nn.Module, prefix: str = "") -> list[tuple[nn.Module, str, str]]:
    """(module, attribute, kind) of every tensor the checkpoint stores quantised whose canonical
    name starts with ``prefix``: "fp4" routed experts, "table" Engram rows (FP8, 1x32 scales),
    "fp8" linears ([32, 32] scales)."""
    found = []
    for module_name, module in model.named_modules():
        own = {**module._parameters, **module._buffers}
        for attr, tensor in own.items():
            name = f"{module_name}.{attr}" if module_name else attr
            if tensor is None or not name.startswith(prefix):
                continue
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                found.append((module, attr, "fp4"))
            elif names.ENGRAM_TABLE.search(name):
                found.append((module, attr, "table"))
            elif names.is_fp8_linear(name):
                found.append((module, attr, "fp8"))
    return found


def enable_qat(model: nn.Module, prefix: str = "") -> int:
    count = 0
    for module, attr, kind in quantised_tensors(model, prefix):
        if not parametrize.is_parametrized(module, attr):
            parametrize.register_parametrization(module, attr, _FakeQuant(kind), unsafe=True)
            count += 1
    return count


def disable_qat(model: nn.Module) -> None:
    for module in list(model.modules()):
        if parametrize.is_parametrized(module):
            for attr in list(module.parametrizations.keys()):
                parametrize.remove_parametrizations(module, attr, leave_parametrized=False)
