"""The checkpoint's weight quantization as config: FP8 E4M3 block-scaled linears, FP4 or FP8 experts.

Read from transformers' ``quantization_config`` (+ a top-level ``expert_dtype``, as DeepSeek's
released config.json has it) or from DeepSeek's inference fields (``dtype: "fp8"``,
``scale_fmt``, ``expert_dtype``, ``scale_dtype``). Normalised to one dict:

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
     "weight_block_size": [128, 128], "scale_fmt": "ue8m0" | "float", "expert_dtype": "fp8" | "fp4"}

The loader reads formats from tensor dtypes; this dict supplies the FP8 block shape and is
written back to config.json unchanged.
"""

from __future__ import annotations

from typing import Any

from deepinfer.engine.loader.config_fields import FieldReader

QUANT_METHODS = ("fp8",)
SCALE_FORMATS = ("ue8m0", "float")
EXPERT_DTYPES = ("fp8", "fp4")
DEFAULT_BLOCK = (128, 128)
FP4_GROUP = 32  # MXFP4: one ue8m0 scale per 32 e2m1 values along the input dim


def parse_quantization(r: FieldReader) -> dict[str, Any] | None:
    qc = r.sub("quantization_config")
    if qc is None:
        if r.get("dtype") != "fp8":
            return None
        # DeepSeek's inference config: FP8 weights; scale_dtype "fp8" means ue8m0 scales.
        scale_fmt = r.get("scale_fmt") or ("ue8m0" if r.get("scale_dtype", "fp8") == "fp8" else "float")
        return _normalised(r, "fp8", "e4m3", "dynamic", list(DEFAULT_BLOCK), scale_fmt, r.get("expert_dtype") or "fp8")
    method = qc.get("quant_method", "fp8")
    if method not in QUANT_METHODS:
        qc.fail("quant_method", f"is {method!r}; supported: {', '.join(QUANT_METHODS)}")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        qc.fail("fmt", f"is {fmt!r}; supported: e4m3")
    block = qc.get("weight_block_size", list(DEFAULT_BLOCK))
    if (
        not isinstance(block, list) or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        qc.fail("weight_block_size", f"must be two positive integers, got {block!r}")
    expert_dtype = qc.get("expert_dtype") or r.get("expert_dtype") or "fp8"
    return _normalised(
        qc, method, fmt, qc.get("activation_scheme", "dynamic"), list(block), qc.get("scale_fmt", "float"), expert_dtype
    )


def _normalised(
    r: FieldReader, method: str, fmt: str, activation: str, block: list[int], scale_fmt: str, expert_dtype: str
) -> dict[str, Any]:
    if scale_fmt not in SCALE_FORMATS:
        r.fail("scale_fmt", f"is {scale_fmt!r}; supported: {', '.join(SCALE_FORMATS)}")
    if expert_dtype not in EXPERT_DTYPES:
        r.fail("expert_dtype", f"is {expert_dtype!r}; supported: {', '.join(EXPERT_DTYPES)}")
    if activation != "dynamic":
        r.fail("activation_scheme", f"is {activation!r}; supported: dynamic")
    return {
        "quant_method": method,
        "fmt": fmt,
        "activation_scheme": activation,
        "weight_block_size": block,
        "scale_fmt": scale_fmt,
        "expert_dtype": expert_dtype,
    }
