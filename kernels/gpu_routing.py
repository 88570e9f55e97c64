"""Which ops the Triton kernels take over, and only for CUDA tensors (imported by ``ops.use_gpu``).

Each wrapper looks at the op's first tensor argument: a CUDA tensor (with a shape the kernel
takes) goes to the kernel, anything else to the routing the op had before, so CPU numbers never
change. The kernels live in gpu_norm / gpu_mhc / gpu_attention / gpu_indexer / gpu_compressor /
gpu_moe / gpu_fp8; their torch_ref counterparts are their oracles (tests/kernels/test_gpu_*.py).
``linear`` and ``grouped_linear`` go to the kernels only with an FP8 weight (``Fp8Weight``); dense
weights keep the previous routing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.kernels import gpu_attention, gpu_compressor, gpu_fp8, gpu_indexer, gpu_mhc, gpu_moe, gpu_norm
from deepinfer.kernels.fp8 import Fp8Weight

_MAX_HEAD_DIM = 1024  # one head row of q and the accumulator stay in registers
_MAX_STREAMS = 16
_MAX_EXPERTS = 4096
_MAX_INDEX_HEADS = 128  # all heads of a token and their [H, BN] scores stay in registers
_MAX_INDEX_DIM = 256
_MAX_COMPRESS_DIM = 1024  # an entry's pooled row stays in registers
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _gathered_ok(q, *_args, **_kw) -> bool:
    return q.shape[-1] <= _MAX_HEAD_DIM and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _index_ok(q, head_weights, keys, *_args, **_kw) -> bool:
    return (q.dim() == 3 and q.shape[1] <= _MAX_INDEX_HEADS and q.shape[2] <= _MAX_INDEX_DIM
            and q.dtype == keys.dtype and keys.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _compress_ok(kv, gate, ring_kv, ring_gate, ring_rows, src_index, src_valid, position_bias, ratio, head_dim,
                 overlap, norm_weight, *_args, **_kw) -> bool:
    return (head_dim <= _MAX_COMPRESS_DIM and kv.dtype in _FLOATS and norm_weight is not None
            and gate.dtype == ring_kv.dtype == ring_gate.dtype == kv.dtype)


def _streams_ok(streams, *_args, **_kw) -> bool:
    return streams.dim() == 3 and streams.shape[1] <= _MAX_STREAMS


def _post_ok(block_out, streams, *_args, **_kw) -> bool:
    return _streams_ok(streams) and block_out.shape[0] == streams.shape[0]


def _route_ok(logits, *_args, **_kw) -> bool:
    return logits.dim() == 2 and logits.shape[1] <= _MAX_EXPERTS


def _experts_ok(out, x, expert_ids, *_args, **_kw) -> bool:
    return expert_ids.shape[1] <= 16 and x.shape[0] >= expert_ids.shape[0] and x.dtype == out.dtype


def _rope_ok(x, cos, *_args, **_kw) -> bool:
    return x.dim() >= 1 and cos.shape[-1] <= x.shape[-1]


def _fp8_linear_ok(x, weight, *_args, **_kw) -> bool:
    return (isinstance(weight, Fp8Weight) and weight.dim() == 2 and x.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.dtype in gpu_fp8.DTYPES)


def _fp8_grouped_ok(x, weight, *_args, **_kw) -> bool:
    return (isinstance(weight, Fp8Weight) and weight.dim() == 3 and x.dim() == 3
            and x.shape[1:] == (weight.shape[0], weight.shape[2]) and x.dtype in gpu_fp8.DTYPES)


def _always(*_args, **_kw) -> bool:
    return True


# op name -> (kernel, does the kernel take these arguments)
KERNELS: dict[str, tuple[Callable, Callable]] = {
    "rms_norm": (gpu_norm.rms_norm, _always),
    "rms_norm_rope": (gpu_norm.rms_norm_rope, _always),
    "apply_rope_": (gpu_norm.apply_rope_, _rope_ok),
    "gathered_attention": (gpu_attention.gathered_attention, _gathered_ok),
    "index_scores": (gpu_indexer.index_scores, _index_ok),
    "compress_pool": (gpu_compressor.compress_pool, _compress_ok),
    "sinkhorn": (gpu_mhc.sinkhorn, lambda comb, *a, **k: comb.dim() == 3 and comb.shape[1] <= _MAX_STREAMS),
    "hc_pre": (gpu_mhc.hc_pre, _streams_ok),
    "hc_post": (gpu_mhc.hc_post, _post_ok),
    "hc_head": (gpu_mhc.hc_head, _streams_ok),
    "swiglu_clamped": (gpu_moe.swiglu_clamped, _always),
    "moe_route": (gpu_moe.moe_route, _route_ok),
    "moe_combine_": (gpu_moe.moe_combine_, lambda out, rows, *a, **k: out.dtype == rows.dtype),
    "moe_experts_": (gpu_moe.moe_experts_, _experts_ok),
    "linear": (gpu_fp8.linear, _fp8_linear_ok),
    "grouped_linear": (gpu_fp8.grouped_linear, _fp8_grouped_ok),
}


def cuda_only(name: str, kernel: Callable, fits: Callable, fallback: Callable) -> Callable:
    """``kernel`` for CUDA arguments it fits, ``fallback`` (the previous routing) otherwise."""

    def op(first, *args, **kwargs):
        if first.is_cuda and fits(first, *args, **kwargs):
            return kernel(first, *args, **kwargs)
        return fallback(first, *args, **kwargs)

    op.__name__ = op.__qualname__ = name
    op.gpu_fallback = fallback
    return op


def routing(active: dict[str, Callable], off: str = "") -> dict[str, Callable]:
    """The wrappers to register over the routing ``active`` (idempotent: a wrapper already in
    place keeps its original fallback); ops named in ``off`` (comma-separated,
    DEEPINFER_TRITON_OFF) keep their previous routing."""
    skipped = {name.strip() for name in off.split(",") if name.strip()}
    unknown = sorted(skipped - set(KERNELS))
    if unknown:
        raise ValueError(f"DEEPINFER_TRITON_OFF names {unknown[0]!r}, which has no Triton kernel; "
                         f"ops with one: {', '.join(KERNELS)}")
    table = {}
    for name, (kernel, fits) in KERNELS.items():
        if name in skipped:
            continue
        previous = active[name]
        table[name] = cuda_only(name, kernel, fits, getattr(previous, "gpu_fallback", previous))
    return table
