"""Typed configuration of DeepSeek-V4.1 (``model_type: deepseek_v41``), from its official config.json.

The official layout nests the text model's fields under ``text_config`` and the vision tower's
under ``vision_config``; ``quantization_config`` (FP8 E4M3 linears with UE8M0 [32, 32] block
scales, ``expert_dtype`` fp4), ``image_token_id`` and the special token ids sit at the top. A flat
file with the text keys at the top level (as vLLM flattens it) reads the same. Defaults are the
released DeepSeek-V4.1-Flash values, so ``V41Config()`` is the real model (for sizing).

``compress_ratios`` in the file has one entry per backbone layer plus one per DSpark stage; the
config keeps the two parts apart (``compress_ratios`` / ``stage_compress_ratios``). Layer roles
and their invariants live in roles.py; bad input raises ``ModelConfigError`` naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.engine.loader.config_fields import FieldReader, ModelConfigError, read_config_json
from deepinfer.engine.models.deepseek_v41.engram import hash_primes
from deepinfer.engine.models.deepseek_v41.roles import LayerRole, RoleError, check_roles, layer_roles
from deepinfer.engine.loader.quant_config import parse_quantization
from deepinfer.engine.models.deepseek_v4.rope_config import RopeConfig, parse_rope

MODEL_TYPE = "deepseek_v41"
ARCHITECTURE = "DeepseekV41ForCausalLM"
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_REAL_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20


@dataclass(frozen=True, slots=True)
class V41Config:
    model_type: str = MODEL_TYPE
    vocab_size: int = 129280
    hidden_size: int = 5120
    moe_intermediate_size: int = 2304
    num_hidden_layers: int = 40
    num_nextn_predict_layers: int = 3  # DSpark stages
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = _REAL_RATIOS  # backbone layers
    stage_compress_ratios: tuple[int, ...] = (0, 0, 0)  # DSpark stages
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20  # -1: no candidate pool
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000  # where the per-head prime search starts
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    max_position_embeddings: int = 1048576
    rope_main: RopeConfig = RopeConfig(theta=10000.0)
    rope_compress: RopeConfig = RopeConfig(theta=160000.0, rope_type="yarn", factor=16.0,
                                           original_max_position_embeddings=65536)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = 2
    image_token_id: int = 129264
    vision: dict[str, Any] | None = field(default_factory=lambda: dict(REAL_VISION))
    quantization: dict[str, Any] | None = field(default_factory=lambda: {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0", "expert_dtype": "fp4"})
    checkpoint_dtype: str | None = "bfloat16"

    # ---- derived -------------------------------------------------------------------
    def compress_ratio(self, layer: int) -> int:
        """Ratio of a backbone layer or (ids from num_hidden_layers on) a DSpark stage."""
        return (self.compress_ratios + self.stage_compress_ratios)[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return False  # V4.1 routes every layer by learned top-k

    @property
    def roles(self) -> tuple[LayerRole, ...]:
        return layer_roles(self.compress_ratios, self.kv_source_layer_ids, self.index_source_layer_ids,
                           self.candidate_source_layer_id, self.engram_layer_ids)

    @property
    def ced_source(self) -> int | None:
        """The first ratio-1 kv source (it projects the decoder's cache from the encoder's output)."""
        return next((s for s in self.kv_source_layer_ids if self.compress_ratios[s] == 1), None)

    @property
    def num_stages(self) -> int:
        return self.num_nextn_predict_layers

    def stage_moe_config(self) -> V41Config:
        """The same config with the DSpark stages' expert counts (for building their MoE)."""
        return dataclasses.replace(self, n_routed_experts=self.dspark_n_routed_experts,
                                   num_experts_per_tok=self.dspark_num_experts_per_tok)

    # ---- parsing -------------------------------------------------------------------
    @classmethod
    def from_dir(cls, model_dir: str | Path) -> V41Config:
        return cls.from_dict(read_config_json(model_dir))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> V41Config:
        if not isinstance(raw, Mapping):
            raise ModelConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        top = FieldReader(raw, ModelConfigError)
        if raw.get("model_type") != MODEL_TYPE:
            raise ModelConfigError(f"config model_type is {raw.get('model_type')!r}, expected {MODEL_TYPE!r}")
        r = top.sub("text_config") or top  # nested official layout, or flat text keys
        d = cls()
        layers = r.int("num_hidden_layers", d.num_hidden_layers)
        stages = r.int("num_nextn_predict_layers", d.num_nextn_predict_layers, minimum=0)
        if r.int("num_key_value_heads", 1) != 1:
            r.fail("num_key_value_heads", "must be 1 (one shared K=V head)")
        if not r.has("compress_ratios"):
            r.fail("compress_ratios", "is required (one ratio per layer and DSpark stage)")
        ratios = r.int_list("compress_ratios")
        if len(ratios) != layers + stages:
            r.fail("compress_ratios", f"has {len(ratios)} entries; num_hidden_layers + num_nextn_predict_layers = "
                   f"{layers} + {stages} = {layers + stages}")
        has_compressed = any(ratios[:layers])
        ids = {}
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "engram_num_embeddings",
                     "dspark_target_layer_ids"):
            required = has_compressed and name in ("kv_source_layer_ids", "index_source_layer_ids")
            if required and not r.has(name):
                r.fail(name, "is required when a layer has a compressed cache")
            ids[name] = tuple(r.int_list(name)) if r.has(name) else ()
        max_pos = r.int("max_position_embeddings", d.max_position_embeddings)
        rope_main, rope_compress = parse_rope(r, max_pos)
        eos = top.int_tuple("eos_token_id", r.int_tuple("eos_token_id", d.eos_token_id))
        cfg = cls(
            vocab_size=r.int("vocab_size", d.vocab_size),
            hidden_size=r.int("hidden_size", d.hidden_size),
            moe_intermediate_size=r.int("moe_intermediate_size", d.moe_intermediate_size),
            num_hidden_layers=layers,
            num_nextn_predict_layers=stages,
            num_attention_heads=r.int("num_attention_heads", d.num_attention_heads),
            head_dim=r.int("head_dim", d.head_dim),
            qk_rope_head_dim=r.int("qk_rope_head_dim", d.qk_rope_head_dim),
            q_lora_rank=r.int("q_lora_rank", d.q_lora_rank),
            o_lora_rank=r.int("o_lora_rank", d.o_lora_rank),
            o_groups=r.int("o_groups", d.o_groups),
            n_routed_experts=r.int("n_routed_experts", d.n_routed_experts),
            n_shared_experts=r.int("n_shared_experts", d.n_shared_experts),
            num_experts_per_tok=r.int("num_experts_per_tok", d.num_experts_per_tok),
            scoring_func=r.choice("scoring_func", d.scoring_func, SCORING_FUNCS),
            norm_topk_prob=r.bool("norm_topk_prob", d.norm_topk_prob),
            routed_scaling_factor=r.float("routed_scaling_factor", d.routed_scaling_factor, positive=True),
            swiglu_limit=r.float("swiglu_limit", d.swiglu_limit, positive=True),
            rms_norm_eps=r.float("rms_norm_eps", d.rms_norm_eps, positive=True),
            sliding_window=r.int("sliding_window", d.sliding_window),
            compress_ratios=tuple(ratios[:layers]),
            stage_compress_ratios=tuple(ratios[layers:]),
            kv_source_layer_ids=ids["kv_source_layer_ids"],
            index_source_layer_ids=ids["index_source_layer_ids"],
            index_n_heads=r.int("index_n_heads", d.index_n_heads),
            index_head_dim=r.int("index_head_dim", d.index_head_dim),
            index_topk=r.int("index_topk", d.index_topk),
            candidate_source_layer_id=r.int("candidate_source_layer_id", -1, minimum=-1),
            candidate_topk_blocks=r.int("candidate_topk_blocks", 0, minimum=0),
            candidate_block_size=r.int("candidate_block_size", 0, minimum=0),
            hc_mult=r.int("hc_mult", d.hc_mult),
            hc_sinkhorn_iters=r.int("hc_sinkhorn_iters", d.hc_sinkhorn_iters),
            hc_eps=r.float("hc_eps", d.hc_eps, positive=True),
            engram_layer_ids=ids["engram_layer_ids"],
            engram_num_embeddings=ids["engram_num_embeddings"],
            engram_max_ngram_size=r.int("engram_max_ngram_size", d.engram_max_ngram_size),
            engram_vocab_size=r.int("engram_vocab_size", d.engram_vocab_size),
            engram_n_heads=r.int("engram_n_heads", d.engram_n_heads),
            engram_head_dim=r.int("engram_head_dim", d.engram_head_dim),
            engram_pad_token_id=r.int("engram_pad_token_id", d.engram_pad_token_id, minimum=0),
            engram_compressed_vocab_size=r.int("engram_compressed_vocab_size", d.engram_compressed_vocab_size),
            dspark_block_size=r.int("dspark_block_size", 0, minimum=0),
            dspark_noise_token_id=r.int("dspark_noise_token_id", 0, minimum=0),
            dspark_target_layer_ids=ids["dspark_target_layer_ids"],
            dspark_markov_rank=r.int("dspark_markov_rank", d.dspark_markov_rank),
            dspark_n_routed_experts=r.int("dspark_n_routed_experts", 0, minimum=0),
            dspark_num_experts_per_tok=r.int("dspark_num_experts_per_tok", 0, minimum=0),
            max_position_embeddings=max_pos,
            rope_main=rope_main,
            rope_compress=rope_compress,
            tie_word_embeddings=r.bool("tie_word_embeddings", False),
            bos_token_id=top.optional_int("bos_token_id", r.optional_int("bos_token_id", d.bos_token_id)),
            eos_token_id=eos,
            pad_token_id=top.optional_int("pad_token_id", r.optional_int("pad_token_id", d.pad_token_id)),
            image_token_id=top.int("image_token_id", r.int("image_token_id", d.image_token_id, minimum=0), minimum=0),
            vision=dict(raw["vision_config"]) if isinstance(raw.get("vision_config"), Mapping) else None,
            quantization=parse_quantization(top),
            checkpoint_dtype=_dtype_name(top.get("dtype") or top.get("torch_dtype") or r.get("dtype")),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Cross-field checks; raises ModelConfigError naming the first bad field."""

        def fail(name: str, why: str) -> None:
            raise ModelConfigError(f"config field 'text_config.{name}' {why}")

        try:
            check_roles(self.compress_ratios, self.stage_compress_ratios, self.kv_source_layer_ids,
                        self.index_source_layer_ids, self.candidate_source_layer_id)
        except RoleError as exc:
            raise ModelConfigError(f"config layer layout: {exc}") from None
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            fail("o_groups", f"({self.o_groups}) must divide num_attention_heads * head_dim")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim):
            fail("qk_rope_head_dim", f"({self.qk_rope_head_dim}) must be even and fit head_dim and index_head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("num_experts_per_tok", f"({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})")
        if self.n_shared_experts != 1:
            fail("n_shared_experts", f"must be 1 (one shared expert), got {self.n_shared_experts}")
        if not self.norm_topk_prob:
            fail("norm_topk_prob", "must be true: routing weights are the chosen scores normalised to sum 1")
        if self.candidate_source_layer_id >= 0:
            k, b = self.candidate_topk_blocks, self.candidate_block_size
            if k < 2 or b < 1:
                fail("candidate_topk_blocks", f"({k}) must be >= 2 and candidate_block_size ({b}) >= 1 with a "
                     "candidate source")
            if self.index_topk > (k - 1) * b:
                # the pool then always holds more reachable positions than a top-k takes
                fail("index_topk", f"({self.index_topk}) must be <= (candidate_topk_blocks - 1) * "
                     f"candidate_block_size = {(k - 1) * b}")
        self._validate_engram(fail)
        self._validate_dspark(fail)
        for token_name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, token_name)
            if value is not None and not 0 <= value < self.vocab_size:
                fail(token_name, f"({value}) is outside the vocabulary [0, {self.vocab_size})")
        for value in self.eos_token_id:
            if not 0 <= value < self.vocab_size:
                fail("eos_token_id", f"({value}) is outside the vocabulary [0, {self.vocab_size})")

    def _validate_engram(self, fail) -> None:
        layers = self.engram_layer_ids
        if not layers:
            return
        if list(layers) != sorted(set(layers)) or not all(0 <= i < self.num_hidden_layers for i in layers):
            fail("engram_layer_ids", f"{list(layers)} must be increasing backbone layer ids")
        if len(self.engram_num_embeddings) != len(layers):
            fail("engram_num_embeddings", f"has {len(self.engram_num_embeddings)} entries for {len(layers)} Engram layers")
        if self.engram_max_ngram_size < 2:
            fail("engram_max_ngram_size", f"must be >= 2, got {self.engram_max_ngram_size}")
        if not 0 <= self.engram_pad_token_id < self.vocab_size:
            fail("engram_pad_token_id", f"({self.engram_pad_token_id}) is outside the vocabulary")
        if self.engram_head_dim % 32:
            fail("engram_head_dim", f"({self.engram_head_dim}) must be a multiple of 32 (one table scale per 32)")
        primes = hash_primes(len(layers), self.engram_max_ngram_size, self.engram_n_heads, self.engram_vocab_size)
        for lid, rows, cols in zip(layers, self.engram_num_embeddings, primes):
            if sum(cols) != rows:
                fail("engram_num_embeddings", f"gives layer {lid} {rows} table rows, but its {len(cols)} hash primes "
                     f"(from engram_vocab_size {self.engram_vocab_size}) sum to {sum(cols)}")

    def _validate_dspark(self, fail) -> None:
        if not self.num_nextn_predict_layers:
            return
        if not self.dspark_target_layer_ids:
            fail("dspark_target_layer_ids", "is required with DSpark stages (num_nextn_predict_layers > 0)")
        if not all(0 <= i < self.num_hidden_layers for i in self.dspark_target_layer_ids):
            fail("dspark_target_layer_ids", f"{list(self.dspark_target_layer_ids)} must be backbone layer ids")
        if self.dspark_n_routed_experts and self.dspark_num_experts_per_tok > self.dspark_n_routed_experts:
            fail("dspark_num_experts_per_tok", "exceeds dspark_n_routed_experts")

    # ---- writing -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """config.json in the official nested layout."""
        text: dict[str, Any] = {"model_type": "deepseek_v41_text"}
        for f in dataclasses.fields(self):
            if f.name in _NOT_TEXT_FIELDS:
                continue
            value = getattr(self, f.name)
            text[f.name] = list(value) if isinstance(value, tuple) else value
        text["compress_ratios"] = [*self.compress_ratios, *self.stage_compress_ratios]
        text["num_key_value_heads"] = 1
        text["rope_theta"] = self.rope_main.theta
        text["compress_rope_theta"] = self.rope_compress.theta
        rc = self.rope_compress
        if rc.rope_type == "yarn":
            text["rope_scaling"] = {"rope_type": "yarn", "factor": rc.factor, "beta_fast": rc.beta_fast,
                                    "beta_slow": rc.beta_slow,
                                    "original_max_position_embeddings": rc.original_max_position_embeddings}
        eos = self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
        d: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "bos_token_id": self.bos_token_id,
                             "eos_token_id": eos, "pad_token_id": self.pad_token_id,
                             "image_token_id": self.image_token_id, "text_config": text}
        if self.vision is not None:
            d["vision_config"] = dict(self.vision)
        if self.quantization is not None:
            d["quantization_config"] = dict(self.quantization)
        if self.checkpoint_dtype is not None:
            d["dtype"] = self.checkpoint_dtype
        return d


_NOT_TEXT_FIELDS = {"model_type", "stage_compress_ratios", "rope_main", "rope_compress", "bos_token_id",
                    "eos_token_id", "pad_token_id", "image_token_id", "vision", "quantization", "checkpoint_dtype"}
REAL_VISION = {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024,
               "num_attention_heads": 16, "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000.0,
               "downsample_ratio": 3, "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None}
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}


def _dtype_name(value) -> str | None:
    return _DTYPE_NAMES.get(value, value) if isinstance(value, str) else None
