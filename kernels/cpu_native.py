"""Native CPU kernels for the per-token scalar work torch runs as many tiny ops.

At decode sizes every torch op costs its dispatch overhead, not its arithmetic. mHC's block
weights (two sigmoids, a softmax and 20 Sinkhorn rounds on an N x N matrix per token, then the
weighted collapse of the N streams) cost ~130 torch/numpy calls per block in the reference,
RMSNorm ~15 internal ops, RoPE ~8, the clamped SwiGLU ~7, attention over a gathered key set
and the mHC stream update ~10 each; here each is one C call, and the MoE dispatch plan is built
in C too. The C sources (kernels/cpu_native_src.py, plus the AVX2 attention and row copies of
cpu_attention_src.py, the fixed-order GEMM and fused blocks of cpu_gemm_src.py and the one-call
MoE of cpu_moe_src.py) are compiled together with the system C compiler on first use into the
cache directory (keyed by a hash of the source) and loaded with ctypes.
Without a compiler, or for tensors that are not contiguous CPU float32, callers get the torch
reference instead (``hc_pre`` here falls back by itself).

Numbers: float32 arithmetic in the reference's order with FMA contraction off (sigmoid in
double, silu with expf), so results match the reference to ~1 ulp; every element runs the same
scalar code wherever it sits in a call, so every token's numbers depend on that token alone.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from deepinfer.kernels import torch_ref
from deepinfer.kernels.cpu_attention_src import ATTENTION_SOURCE
from deepinfer.kernels.cpu_gemm_src import GEMM_SOURCE
from deepinfer.kernels.cpu_moe_src import MOE_SOURCE
from deepinfer.kernels.cpu_native_src import C_SOURCE

log = logging.getLogger(__name__)

MAX_HC = 16

_lib: ctypes.CDLL | None = None
_tried = False
_enabled = True


def _cache_dir() -> Path:
    from deepinfer import envs

    return Path(envs.get().cache_dir) / "kernels"


def _build() -> ctypes.CDLL | None:
    source = C_SOURCE + ATTENTION_SOURCE + GEMM_SOURCE + MOE_SOURCE  # later parts call earlier ones
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_native_{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "cpu_native.c"
            src.write_text(source)
            built = Path(tmp) / "cpu_native.so"
            cmd = ["cc", "-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", str(src), "-o", str(built), "-lm"]
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            tmp_target = out.with_suffix(f".{os.getpid()}.tmp")
            tmp_target.write_bytes(built.read_bytes())
            os.replace(tmp_target, out)  # atomic: concurrent builders never see half a file
    lib = ctypes.CDLL(str(out))
    f32p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.hc_pre.argtypes = [f32p, f32p, f32p, f32p, ctypes.c_float, f32p, i64, i64, i64, i64, ctypes.c_float, f32p, f32p, f32p]
    lib.hc_pre.restype = None
    lib.rms_norm.argtypes = [f32p, i64, i64, i64, i64, i64, f32p, ctypes.c_float, f32p]
    lib.rms_norm.restype = None
    lib.rope.argtypes = [f32p, i64, i64, i64, i64, i64, i64, f32p, f32p]
    lib.rope.restype = None
    lib.swiglu.argtypes = [f32p, i64, i64, ctypes.c_float, f32p]
    lib.swiglu.restype = None
    lib.moe_route.argtypes = [f32p, i64, i64, f32p, f32p, i64, i64, ctypes.c_float, f32p, f32p]
    lib.moe_route.restype = None
    lib.moe_combine.argtypes = [f32p, f32p, f32p, f32p, i64, i64, i64]
    lib.moe_combine.restype = None
    lib.gathered_attention.argtypes = [f32p, f32p, f32p, f32p, i64, f32p, f32p, f32p, i64, f32p, i64, i64, i64,
                                       ctypes.c_float, f32p, f32p]  # fmt: skip
    lib.gathered_attention.restype = None
    lib.ring_write.argtypes = [f32p, f32p, f32p, i64, f32p, i64, i64]
    lib.ring_write.restype = None
    lib.window_pool.argtypes = [f32p, f32p, i64, f32p, i64, i64, f32p, f32p, i64, f32p]
    lib.window_pool.restype = None
    if hasattr(lib, "gathered_attention_avx2"):  # x86-64 builds only
        lib.gathered_attention_avx2.argtypes = lib.gathered_attention.argtypes
        lib.gathered_attention_avx2.restype = None
        lib.window_attention_avx2.argtypes = [f32p, f32p, f32p, i64, f32p, i64, f32p, f32p, i64, f32p, f32p, f32p, i64,
                                              f32p, i64, i64, i64, ctypes.c_float, f32p, f32p]  # fmt: skip
        lib.window_attention_avx2.restype = i64
    lib.hc_post.argtypes = [f32p, f32p, f32p, f32p, i64, i64, i64, f32p]
    lib.hc_post.restype = None
    lib.moe_dispatch.argtypes = [f32p, i64, i64, i64, i64, i64, f32p, f32p, f32p, f32p, f32p, f32p]
    lib.moe_dispatch.restype = None
    from deepinfer.kernels import cpu_gemm

    cpu_gemm.declare(lib)
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None when it cannot be built or is disabled."""
    global _lib, _tried
    if not _enabled:
        return None
    if not _tried:
        _tried = True
        try:
            _lib = _build()
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("native CPU kernels unavailable (%s); using the torch reference", exc)
            _lib = None
    return _lib


def set_enabled(enabled: bool) -> None:
    """Turn the native kernels off (tests compare against the reference) or back on."""
    global _enabled
    _enabled = enabled


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    pre_post_scale: torch.Tensor,
    pre_post_base: torch.Tensor,
    comb_scale: torch.Tensor | float,
    comb_base: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    batch_invariant: bool = False,
):
    """``torch_ref.hc_pre`` with everything after the projection in one native call."""
    t, n, d = streams.shape
    lib = library() if streams.device.type == "cpu" and streams.dtype == torch.float32 and n <= MAX_HC else None
    if lib is None:
        return torch_ref.hc_pre(
            streams, fn, pre_post_scale, pre_post_base, comb_scale, comb_base,
            norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, batch_invariant=batch_invariant,
        )  # fmt: skip
    from deepinfer.kernels import cpu_gemm

    streams = streams.contiguous()
    fused = cpu_gemm.usable(fn)
    if not fused:
        flat = rms_norm(streams.view(t, n * d), None, norm_eps)
        mixes = torch_ref.linear(flat, fn, batch_invariant).contiguous()
    out = torch.empty(t * (n + n * n + d), dtype=torch.float32)  # one allocation for the three results
    post, comb, collapsed = out.split([t * n, t * n * n, t * d])
    post, comb, collapsed = post.view(t, n), comb.view(t, n, n), collapsed.view(t, d)
    if pre_post_scale.dtype is not torch.float32 or not pre_post_scale.is_contiguous():
        pre_post_scale = pre_post_scale.float().contiguous()
    if pre_post_base.dtype is not torch.float32 or not pre_post_base.is_contiguous():
        pre_post_base = pre_post_base.float().contiguous()
    if comb_base.dtype is not torch.float32 or not comb_base.is_contiguous():
        comb_base = comb_base.float().contiguous()
    if fused:  # norm, mixes GEMM and the weights in one native call (kernels/cpu_gemm_src.py)
        scratch = torch.empty(t * (n * d + (2 + n) * n), dtype=torch.float32)
        lib.hc_pre_fused(
            streams.data_ptr(), cpu_gemm.packed(fn, lib).data_ptr(), pre_post_scale.data_ptr(),
            pre_post_base.data_ptr(), float(comb_scale), comb_base.data_ptr(), t, n, d, sinkhorn_iters, norm_eps,
            hc_eps, scratch.data_ptr(), post.data_ptr(), comb.data_ptr(), collapsed.data_ptr(),
        )  # fmt: skip
        return post, comb, collapsed
    lib.hc_pre(
        mixes.data_ptr(), streams.data_ptr(), pre_post_scale.data_ptr(), pre_post_base.data_ptr(), float(comb_scale),
        comb_base.data_ptr(), t, n, d, sinkhorn_iters, hc_eps, post.data_ptr(), comb.data_ptr(), collapsed.data_ptr(),
    )  # fmt: skip
    return post, comb, collapsed


def _native_f32(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    for t in tensors:  # a plain loop: this runs ~300 times per decode step
        if t.dtype is not torch.float32 or not t.is_cpu:
            return None
    return library()


def _rows(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(outer, inner, outer stride, inner stride) of ``x``'s rows, last dim contiguous; None if
    the layout does not fit two levels of rows."""
    shape, stride = x.shape, x.stride()  # one call each: this runs ~70 times per decode step
    if stride[-1] != 1:
        return None
    if len(shape) == 2:
        return shape[0], 1, stride[0], 0
    if len(shape) == 3:
        return shape[0], shape[1], stride[0], stride[1]
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    lib = _native_f32(x) if weight is None or weight.dtype is torch.float32 else None
    rows = _rows(x) if lib is not None else None
    if rows is None:
        return torch_ref.rms_norm(x, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    w = 0 if weight is None else weight.contiguous().data_ptr()
    lib.rms_norm(x.data_ptr(), *rows, x.shape[-1], w, eps, out.data_ptr())
    return out


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    lib = _native_f32(x, cos, sin)
    rows = _rows(x) if lib is not None else None
    if rows is None or not (cos.is_contiguous() and sin.is_contiguous()) or cos.shape[0] != x.shape[0]:
        return torch_ref.apply_rope_(x, cos, sin)
    lib.rope(x.data_ptr(), *rows, x.shape[-1], cos.shape[-1], cos.data_ptr(), sin.data_ptr())
    return x


def swiglu_clamped(gate_up: torch.Tensor, limit: float, batch_invariant: bool = False) -> torch.Tensor:
    lib = _native_f32(gate_up)
    if lib is None or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return torch_ref.swiglu_clamped(gate_up, limit, batch_invariant)
    rows, m = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, m, dtype=gate_up.dtype)
    lib.swiglu_fast(gate_up.data_ptr(), rows, m, limit, out.data_ptr())  # SIMD where the CPU has it
    return out


_SCORING_CODES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
MAX_EXPERTS = 1024


def moe_route(logits, correction_bias, hash_ids, top_k, scoring_func, routed_scaling_factor, batch_invariant=False):
    lib = _native_f32(logits)
    if lib is None or scoring_func not in _SCORING_CODES or logits.shape[-1] > MAX_EXPERTS or logits.dim() != 2:
        return torch_ref.moe_route(logits, correction_bias, hash_ids, top_k, scoring_func,
                                   routed_scaling_factor, batch_invariant)  # fmt: skip
    logits = logits.contiguous()
    rows, e = logits.shape
    ids = torch.empty(rows, top_k, dtype=torch.long)
    weights = torch.empty(rows, top_k, dtype=torch.float32)
    bias = 0 if correction_bias is None or hash_ids is not None else correction_bias.float().contiguous().data_ptr()
    hashed = 0 if hash_ids is None else hash_ids.contiguous().data_ptr()
    lib.moe_route(logits.data_ptr(), rows, e, bias, hashed, top_k, _SCORING_CODES[scoring_func],
                  routed_scaling_factor, ids.data_ptr(), weights.data_ptr())  # fmt: skip
    return ids, weights


def moe_combine_(out: torch.Tensor, rows: torch.Tensor, row_of_pair: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    lib = _native_f32(out, rows, weights)
    if lib is None or not (out.is_contiguous() and rows.is_contiguous()) or row_of_pair.device.type != "cpu":
        return torch_ref.moe_combine_(out, rows, row_of_pair, weights)
    t, k = weights.shape
    row_of_pair, weights = row_of_pair.contiguous(), weights.contiguous()
    lib.moe_combine(out.data_ptr(), rows.data_ptr(), row_of_pair.data_ptr(), weights.data_ptr(), t, k, out.shape[-1])
    return out


def gathered_attention(q, pool, pool_rows, pool_bias, extra, extra_rows, extra_bias, sinks, scale, batch_invariant=False):
    """``torch_ref.gathered_attention`` in one native call: key rows are read in place, never gathered."""
    tensors = (q, pool, pool_bias, sinks) + (() if extra is None else (extra, extra_bias))
    is_long = pool_rows.dtype == torch.long and (extra is None or extra_rows.dtype == torch.long)
    lib = _native_f32(*tensors) if pool_rows.device.type == "cpu" and is_long else None
    if lib is None or q.shape[-1] % 8 or q.dim() != 3:
        return torch_ref.gathered_attention(q, pool, pool_rows, pool_bias, extra, extra_rows, extra_bias, sinks,
                                            scale, batch_invariant)  # fmt: skip
    g, h, d = q.shape
    q, pool, sinks = q.contiguous(), pool.contiguous(), sinks.contiguous()
    pool_rows, pool_bias = pool_rows.contiguous(), pool_bias.contiguous()
    np_, ne = pool_rows.shape[1], 0 if extra is None else extra_rows.shape[1]
    extra_ptr = rows_ptr = bias_ptr = 0
    if extra is not None:
        extra, extra_rows, extra_bias = extra.contiguous(), extra_rows.contiguous(), extra_bias.contiguous()
        extra_ptr, rows_ptr, bias_ptr = extra.data_ptr(), extra_rows.data_ptr(), extra_bias.data_ptr()
    out = torch.empty(g, h, d, dtype=torch.float32)
    from deepinfer.kernels import cpu_gemm

    if cpu_gemm.usable(q):  # the SIMD kernel (kernels/cpu_attention_src.py)
        kernel, hp = lib.gathered_attention_avx2, -(-h // 8) * 8
        scratch = torch.empty((np_ + ne) * (hp + 3) + d * hp, dtype=torch.float32)
    else:
        kernel, scratch = lib.gathered_attention, torch.empty(h * (np_ + ne), dtype=torch.float32)
    kernel(q.data_ptr(), pool.data_ptr(), pool_rows.data_ptr(), pool_bias.data_ptr(), np_, extra_ptr, rows_ptr,
           bias_ptr, ne, sinks.data_ptr(), g, h, d, scale, scratch.data_ptr(), out.data_ptr())  # fmt: skip
    return out


def hc_post(block_out, streams, post, comb, batch_invariant: bool = False) -> torch.Tensor:
    """``torch_ref.hc_post`` in one native call (per row, fixed order)."""
    lib = _native_f32(block_out, streams, post, comb)
    if lib is None or streams.dim() != 3:
        return torch_ref.hc_post(block_out, streams, post, comb, batch_invariant)
    rows, n, d = streams.shape
    block_out, streams = block_out.contiguous(), streams.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    result = torch.empty_like(streams)
    lib.hc_post(block_out.data_ptr(), streams.data_ptr(), post.data_ptr(), comb.data_ptr(), rows, n, d, result.data_ptr())
    return result


def moe_dispatch(expert_ids: torch.Tensor, num_experts: int, batch_invariant: bool, dense_cost: int):
    """The MoE dispatch plan in one native call: (token_of_row, row_of_pair, segments,
    rows_per_expert) with the layout of ``MoE.dispatch``; None when the kernels are unavailable."""
    lib = library() if expert_ids.is_cpu and expert_ids.dtype is torch.long else None
    if lib is None:
        return None
    ids = expert_ids.contiguous()
    t, k = ids.shape
    pairs = t * k
    max_rows = max(pairs + 3 * num_experts, num_experts * torch_ref.gemm_rows(t))
    buf = torch.empty(2 * num_experts + max_rows + pairs + 3 * num_experts + 3, dtype=torch.long)
    ptr, size = buf.data_ptr(), buf.element_size()
    offsets, at = [], 0
    for n in (num_experts, num_experts, max_rows, pairs, 3 * num_experts, 3):
        offsets.append(ptr + at * size)
        at += n
    lib.moe_dispatch(ids.data_ptr(), pairs, k, num_experts, int(batch_invariant), dense_cost, *offsets)
    num_rows, num_segments, rows_per_expert = buf[-3:].tolist()
    first_row = 2 * num_experts
    token_of_row = buf[first_row : first_row + num_rows]
    row_of_pair = buf[first_row + max_rows : first_row + max_rows + pairs]
    seg_at = first_row + max_rows + pairs
    flat = buf[seg_at : seg_at + 3 * num_segments].tolist()
    segments = [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)]
    return token_of_row, row_of_pair, segments, rows_per_expert


def _host_rows(*index: torch.Tensor) -> bool:
    for t in index:
        if t.dtype is not torch.long or not t.is_cpu or not t.is_contiguous():
            return False
    return True


def ring_write(ring: torch.Tensor, fresh: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> bool:
    """``ring[rows] = fresh[src]`` in one native call (rows of ``fresh`` may be strided); False
    when the native path does not apply (the caller then uses torch)."""
    lib = _native_f32(ring, fresh) if _host_rows(rows, src) else None
    if lib is None or ring.dim() != 2 or fresh.dim() != 2 or not ring.is_contiguous() or fresh.stride(1) != 1:
        return False
    lib.ring_write(ring.data_ptr(), rows.data_ptr(), src.data_ptr(), rows.shape[0], fresh.data_ptr(),
                   fresh.stride(0), ring.shape[1])  # fmt: skip
    return True


def window_pool(ring: torch.Tensor, ring_rows: torch.Tensor, fresh: torch.Tensor, rows: torch.Tensor,
                src: torch.Tensor) -> torch.Tensor | None:
    """``cat([ring[ring_rows], fresh, zero row])``, then ``ring[rows] = fresh[src]``, in one native
    call; None when it does not apply."""
    lib = _native_f32(ring, fresh) if _host_rows(ring_rows, rows, src) else None
    if lib is None or ring.dim() != 2 or not ring.is_contiguous() or not fresh.is_contiguous():
        return None
    nr, (nf, width) = ring_rows.shape[0], fresh.shape
    pool = torch.empty(nr + nf + 1, width, dtype=torch.float32)
    lib.window_pool(ring.data_ptr(), ring_rows.data_ptr(), nr, fresh.data_ptr(), nf, width, rows.data_ptr(),
                    src.data_ptr(), rows.shape[0], pool.data_ptr())  # fmt: skip
    return pool


def window_attention(q, ring, ring_rows, fresh, pool_rows, pool_bias, extra, extra_rows, extra_bias, sinks, scale):
    """``gathered_attention`` over the window pool ``cat([ring[ring_rows], fresh, zero row])``
    without building it (the SIMD kernel reads ring and fresh rows in place); the caller writes
    ``fresh`` to the ring afterwards. None when it does not apply."""
    from deepinfer.kernels import cpu_gemm

    tensors = (q, ring, fresh, pool_bias, sinks) + (() if extra is None else (extra, extra_bias))
    index = (ring_rows, pool_rows) + (() if extra is None else (extra_rows,))
    lib = _native_f32(*tensors) if _host_rows(*index) and cpu_gemm.usable(q) else None
    if lib is None or q.dim() != 3 or q.shape[-1] % 8 or not (ring.is_contiguous() and fresh.is_contiguous()):
        return None
    g, h, d = q.shape
    if ring.shape[-1] != d or fresh.shape[-1] != d:
        return None
    q, sinks, pool_bias = q.contiguous(), sinks.contiguous(), pool_bias.contiguous()
    np_, ne = pool_rows.shape[1], 0 if extra is None else extra_rows.shape[1]
    extra_ptr = rows_ptr = bias_ptr = 0
    if extra is not None:
        extra, extra_bias = extra.contiguous(), extra_bias.contiguous()
        extra_ptr, rows_ptr, bias_ptr = extra.data_ptr(), extra_rows.data_ptr(), extra_bias.data_ptr()
    hp = -(-h // 8) * 8
    out = torch.empty(g, h, d, dtype=torch.float32)
    scratch = torch.empty((np_ + ne) * (hp + 3) + d * hp, dtype=torch.float32)
    status = lib.window_attention_avx2(
        q.data_ptr(), ring.data_ptr(), ring_rows.data_ptr(), ring_rows.shape[0], fresh.data_ptr(), fresh.shape[0],
        pool_rows.data_ptr(), pool_bias.data_ptr(), np_, extra_ptr, rows_ptr, bias_ptr, ne, sinks.data_ptr(), g, h, d,
        scale, scratch.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if status:
        raise MemoryError("window_attention: out of host memory for the row table")
    return out
