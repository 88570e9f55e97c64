"""The one dispatch point for device ops: model code calls ``ops.NAME(...)`` and never imports a
backend directly.

Today every op is the torch reference (kernels/torch_ref.py), which runs on CPU and CUDA alike.
A faster backend (Triton/CuPy on NVIDIA) registers replacements for the ops it implements with
``register``; ops it does not implement keep the reference. The reference stays the oracle: a
backend's tests compare against it.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer.kernels import torch_ref

OP_NAMES = (
    "linear",
    "grouped_linear",
    "bmm",
    "sigmoid",
    "silu",
    "softplus",
    "rms_norm",
    "rms_norm_unweighted",
    "rope_cos_sin",
    "apply_rope",
    "attention_with_sink",
    "sinkhorn",
    "hc_pre",
    "hc_post",
    "hc_head",
    "swiglu_clamped",
)

_reference: dict[str, Callable] = {name: getattr(torch_ref, name) for name in OP_NAMES}
_active: dict[str, Callable] = dict(_reference)


def register(name: str, fn: Callable) -> None:
    """Route op ``name`` to ``fn`` (same signature and numbers as the reference, within tolerance)."""
    if name not in _reference:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(OP_NAMES)}")
    _active[name] = fn
    globals()[name] = fn


def reset() -> None:
    """Route every op back to the torch reference."""
    _active.update(_reference)
    globals().update(_reference)


def backend_of(name: str) -> str:
    fn = _active[name]
    return "torch_ref" if fn is _reference[name] else getattr(fn, "__module__", "custom")


linear = torch_ref.linear
grouped_linear = torch_ref.grouped_linear
bmm = torch_ref.bmm
sigmoid = torch_ref.sigmoid
silu = torch_ref.silu
softplus = torch_ref.softplus
rms_norm = torch_ref.rms_norm
rms_norm_unweighted = torch_ref.rms_norm_unweighted
rope_cos_sin = torch_ref.rope_cos_sin
apply_rope = torch_ref.apply_rope
attention_with_sink = torch_ref.attention_with_sink
sinkhorn = torch_ref.sinkhorn
hc_pre = torch_ref.hc_pre
hc_post = torch_ref.hc_post
hc_head = torch_ref.hc_head
swiglu_clamped = torch_ref.swiglu_clamped
