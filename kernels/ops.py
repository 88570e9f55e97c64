"""The one dispatch point for device ops: model code calls ``ops.NAME(...)`` and never imports a
backend directly.

Every op has a torch reference (kernels/torch_ref.py) that runs on CPU and CUDA alike and is the
oracle for every other backend. The default routing adds the native CPU kernels
(kernels/cpu_native.py, and the fixed-order GEMMs of kernels/cpu_gemm.py), which fall back to the reference for anything they do not handle.
A faster backend (Triton/CuPy on NVIDIA) registers replacements for the ops it implements with
``register``; ``reset`` restores the default routing and ``use_reference`` the pure reference.
``use_gpu`` registers the Triton kernels (kernels/gpu_routing.py) for CUDA tensors only.

Three ops exist for fused backends: ``rms_norm_rope`` (by default ``apply_rope_(rms_norm(...))``
through the current routing, so CPU numbers stay those of the two ops), ``compress_pool`` (a gated
compressor's pooling, by default the reference's pooling then ``rms_norm`` through the current
routing, for the same reason) and ``moe_experts_`` (routed experts of a MoE block; its reference
is an expert-by-expert oracle, so models call it only where ``backend_of("moe_experts_")`` names a
fused backend).
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer.kernels import cpu_gemm, cpu_native, torch_ref

OP_NAMES = (
    "linear",
    "grouped_linear",
    "bmm",
    "sigmoid",
    "silu",
    "softplus",
    "rms_norm",
    "rope_tables",
    "apply_rope_",
    "attention_with_sink",
    "gathered_attention",
    "index_scores",
    "sinkhorn",
    "hc_pre",
    "hc_post",
    "hc_head",
    "swiglu_clamped",
    "moe_route",
    "moe_combine_",
    "rms_norm_rope",
    "compress_pool",
    "moe_experts_",
)


def _compress_pool(kv, gate, ring_kv, ring_gate, ring_rows, src_index, src_valid, position_bias, ratio, head_dim,
                   overlap, norm_weight, eps):
    """The reference's pooling, then ``rms_norm`` through the current routing."""
    pooled = torch_ref.compress_pooled(kv, gate, ring_kv, ring_gate, ring_rows, src_index, src_valid, position_bias,
                                       ratio, head_dim, overlap)
    return rms_norm(pooled, norm_weight, eps)


_reference: dict[str, Callable] = {name: getattr(torch_ref, name) for name in OP_NAMES}
_default: dict[str, Callable] = {
    **_reference,
    **{
        name: getattr(cpu_native, name)
        for name in (
            "hc_pre", "rms_norm", "apply_rope_", "swiglu_clamped", "moe_route", "moe_combine_", "gathered_attention", "hc_post",
        )  # fmt: skip
    },
    "linear": cpu_gemm.linear,
    "grouped_linear": cpu_gemm.grouped_linear,
    "rms_norm_rope": lambda x, weight, eps, cos, sin: apply_rope_(rms_norm(x, weight, eps), cos, sin),
    "compress_pool": _compress_pool,
}
_active: dict[str, Callable] = {}


def register(name: str, fn: Callable) -> None:
    """Route op ``name`` to ``fn`` (same signature and numbers as the reference, within tolerance)."""
    if name not in _reference:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(OP_NAMES)}")
    _active[name] = fn
    globals()[name] = fn


def reset() -> None:
    """Restore the default routing (reference + native CPU kernels)."""
    for name, fn in _default.items():
        register(name, fn)


def use_reference() -> None:
    """Route every op to the torch reference."""
    for name, fn in _reference.items():
        register(name, fn)


def use_gpu() -> bool:
    """Route CUDA tensors of the ops the Triton kernels implement to them, keeping the current
    routing for everything else; False (nothing changed) without CUDA or Triton, or with
    ``DEEPINFER_ACCELERATOR=cpu``. Idempotent; ``reset`` undoes it."""
    import torch

    from deepinfer import envs

    if envs.get().accelerator == "cpu" or not torch.cuda.is_available():
        return False
    try:
        from deepinfer.kernels import gpu_routing
    except ImportError:  # no Triton: the torch ops run on the GPU
        return False
    for name, fn in gpu_routing.routing(_active, envs.get().triton_off).items():
        register(name, fn)
    return True


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
rope_tables = torch_ref.rope_tables
apply_rope_ = torch_ref.apply_rope_
attention_with_sink = torch_ref.attention_with_sink
gathered_attention = torch_ref.gathered_attention
index_scores = torch_ref.index_scores
sinkhorn = torch_ref.sinkhorn
hc_pre = cpu_native.hc_pre
hc_post = torch_ref.hc_post
hc_head = torch_ref.hc_head
swiglu_clamped = torch_ref.swiglu_clamped
moe_route = torch_ref.moe_route
moe_combine_ = torch_ref.moe_combine_
rms_norm_rope = torch_ref.rms_norm_rope
compress_pool = torch_ref.compress_pool
moe_experts_ = torch_ref.moe_experts_
reset()
