"""V4's two rotary embeddings as config: "main" (window-only layers) and "compress" (CSA/HCA).

Config spellings read by ``parse_rope``:
- nested ``rope_parameters`` = {"main": {...}, "compress": {...}} (transformers);
- flat ``rope_parameters`` or legacy ``rope_scaling`` = YaRN settings of the *compressed* layers
  only (DeepSeek's released config); window-only layers keep plain RoPE at ``rope_theta``;
- DeepSeek's inference fields ``rope_factor``/``original_seq_len``/``beta_fast``/``beta_slow``
  (YaRN on when ``original_seq_len`` > 0).
``rope_theta`` and ``compress_rope_theta`` give the two bases.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from deepinfer.engine.loader.config_fields import FieldReader

ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True  # YaRN: round the ramp bounds outwards (floor/ceil), as V4 does


def parse_rope(r: FieldReader, max_positions: int) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) rope settings of one config object."""
    main_theta = r.float("rope_theta", 10000.0, positive=True)
    compress_theta = r.float("compress_rope_theta", 160000.0, positive=True)
    params = r.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get("main"), Mapping):
        nested = r.sub("rope_parameters")
        main = _one(nested.sub("main"), main_theta, max_positions, attention_default=None)
        compress_reader = nested.sub("compress")
        if compress_reader is None:
            nested.fail("compress", "is missing next to 'main'")
        compress = _one(compress_reader, compress_theta, max_positions, attention_default=None)
        return main, compress
    for name in ("rope_parameters", "rope_scaling"):
        flat = r.sub(name)
        if flat is not None:
            # A flat dict describes the compressed layers' YaRN; its own rope_theta (if any) is
            # the main base that transformers folds into rope_parameters, never the compress one.
            if not r.has("rope_theta") and flat.has("rope_theta"):
                main_theta = flat.float("rope_theta", main_theta, positive=True)
            compress = _one(flat, compress_theta, max_positions, attention_default=1.0, theta_from_field=False)
            return RopeConfig(theta=main_theta), compress
    original = r.int("original_seq_len", 0, minimum=0)
    if original > 0:
        compress = RopeConfig(
            theta=compress_theta,
            rope_type="yarn",
            factor=r.float("rope_factor", 1.0, positive=True),
            original_max_position_embeddings=original,
            beta_fast=r.float("beta_fast", 32.0),
            beta_slow=r.float("beta_slow", 1.0),
        )
        return RopeConfig(theta=main_theta), compress
    return RopeConfig(theta=main_theta), RopeConfig(theta=compress_theta)


def _one(
    r: FieldReader,
    theta: float,
    max_positions: int,
    attention_default: float | None,
    theta_from_field: bool = True,
) -> RopeConfig:
    rope_type = r.get("rope_type") or r.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        r.fail("rope_type", f"is {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if theta_from_field:
        theta = r.float("rope_theta", theta, positive=True)
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if not r.has("original_max_position_embeddings"):
        r.fail("original_max_position_embeddings", "is required for yarn rope")
    original = r.int("original_max_position_embeddings", 1)
    factor = r.float("factor", max_positions / original, positive=True)
    attention_factor = r.get("attention_factor")
    if attention_factor is None:
        attention_factor = attention_default
    if attention_factor is None:
        attention_factor = _yarn_attention_factor(factor, r.get("mscale"), r.get("mscale_all_dim"))
    else:
        attention_factor = r.float("attention_factor", float(attention_factor), positive=True)
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=r.float("beta_fast", 32.0),
        beta_slow=r.float("beta_slow", 1.0),
        attention_factor=float(attention_factor),
        truncate=r.bool("truncate", True),
    )


def _yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """YaRN's cos/sin scale when the config leaves it unset (the paper's 0.1 ln(s) + 1)."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)
