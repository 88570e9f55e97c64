"""Native CPU kernels for the per-token scalar work torch runs as many tiny ops.

At decode sizes every torch op costs its dispatch overhead, not its arithmetic. mHC's block
weights (two sigmoids, a softmax and 20 Sinkhorn rounds on an N x N matrix per token, then the
weighted collapse of the N streams) cost ~130 torch/numpy calls per block in the reference,
RMSNorm ~15 internal ops, RoPE ~8, the clamped SwiGLU ~7; here each is one C call. The C source below is compiled with the system C compiler
on first use into the cache directory (keyed by a hash of the source) and loaded with ctypes.
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

log = logging.getLogger(__name__)

MAX_HC = 16

C_SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* mixes [rows, (2+n)*n]: pre | post | comb logits (before scale and bias); streams [rows, n, d].
   Outputs: post [rows, n], comb [rows, n, n], collapsed [rows, d]. */
void hc_pre(const float* mixes, const float* streams, const float* pp_scale, const float* pp_base,
            float comb_scale, const float* comb_base, int64_t rows, int64_t n, int64_t d,
            int64_t iters, float hc_eps, float* post, float* comb, float* collapsed) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* m = mixes + r * (2 + n) * n;
        float pre[16];
        for (int64_t j = 0; j < 2 * n; ++j) {
            float z = m[j] * pp_scale[j];
            z = z + pp_base[j];
            float s = (float)(1.0 / (1.0 + exp(-(double)z)));
            if (j < n) pre[j] = s + hc_eps;
            else post[r * n + (j - n)] = s * 2.0f;
        }
        float* c = comb + r * n * n;
        for (int64_t i = 0; i < n; ++i) {
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; ++j) {
                float z = m[2 * n + i * n + j] * comb_scale;
                z = z + comb_base[i * n + j];
                c[i * n + j] = z;
                if (z > mx) mx = z;
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < n; ++j) {
                float e = (float)exp((double)(c[i * n + j] - mx));
                c[i * n + j] = e;
                sum = sum + e;
            }
            for (int64_t j = 0; j < n; ++j) c[i * n + j] = c[i * n + j] / sum + hc_eps;
        }
        for (int64_t it = 0; it < iters; ++it) {
            if (it > 0) {
                for (int64_t i = 0; i < n; ++i) {
                    float s = c[i * n];
                    for (int64_t j = 1; j < n; ++j) s = s + c[i * n + j];
                    s = s + hc_eps;
                    for (int64_t j = 0; j < n; ++j) c[i * n + j] = c[i * n + j] / s;
                }
            }
            for (int64_t j = 0; j < n; ++j) {
                float s = c[j];
                for (int64_t i = 1; i < n; ++i) s = s + c[i * n + j];
                s = s + hc_eps;
                for (int64_t i = 0; i < n; ++i) c[i * n + j] = c[i * n + j] / s;
            }
        }
        const float* x = streams + r * n * d;
        float* out = collapsed + r * d;
        for (int64_t k = 0; k < d; ++k) {
            float acc = pre[0] * x[k];
            for (int64_t j = 1; j < n; ++j) acc = acc + pre[j] * x[j * d + k];
            out[k] = acc;
        }
    }
}

/* RMSNorm of rows x[o * so + i * si + 0..d) (o < outer, i < inner) into contiguous out;
   weight may be NULL. */
void rms_norm(const float* x, int64_t outer, int64_t inner, int64_t so, int64_t si, int64_t d,
              const float* weight, float eps, float* out) {
    for (int64_t o = 0; o < outer; ++o) {
        for (int64_t i = 0; i < inner; ++i) {
            const float* row = x + o * so + i * si;
            float* dst = out + (o * inner + i) * d;
            float ss = 0.0f;
            for (int64_t k = 0; k < d; ++k) ss = ss + row[k] * row[k];
            float r = 1.0f / sqrtf(ss / (float)d + eps);
            if (weight) for (int64_t k = 0; k < d; ++k) dst[k] = weight[k] * (row[k] * r);
            else for (int64_t k = 0; k < d; ++k) dst[k] = row[k] * r;
        }
    }
}

/* In-place interleaved RoPE of the last rd channels of rows x[o * so + i * si + 0..d);
   cos/sin [outer, rd] full-width tables (sin signed: -s on even, +s on odd channels). */
void rope(float* x, int64_t outer, int64_t inner, int64_t so, int64_t si, int64_t d, int64_t rd,
          const float* cos_t, const float* sin_t) {
    for (int64_t o = 0; o < outer; ++o) {
        const float* c = cos_t + o * rd;
        const float* s = sin_t + o * rd;
        for (int64_t i = 0; i < inner; ++i) {
            float* p = x + o * so + i * si + (d - rd);
            for (int64_t k = 0; k < rd; k += 2) {
                float e = p[k], od = p[k + 1];
                float a = e * c[k], b = od * s[k];
                float a2 = od * c[k + 1], b2 = e * s[k + 1];
                p[k] = a + b;
                p[k + 1] = a2 + b2;
            }
        }
    }
}

/* Router: logits [rows, e] -> ids [rows, k] ascending (int64), weights [rows, k].
   scoring 0 = sqrt(softplus), 1 = sigmoid, 2 = softmax; hash_ids [rows, k] or NULL (then top-k
   of score + bias, lowest id first on ties); weights = chosen scores / (sum + 1e-20) * scale. */
void moe_route(const float* logits, int64_t rows, int64_t e, const float* bias, const int64_t* hash_ids,
               int64_t k, int64_t scoring, float scale, int64_t* ids, float* weights) {
    float scores[1024];
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = logits + r * e;
        if (scoring == 2) {
            float mx = x[0];
            for (int64_t j = 1; j < e; ++j) if (x[j] > mx) mx = x[j];
            float sum = 0.0f;
            for (int64_t j = 0; j < e; ++j) { scores[j] = expf(x[j] - mx); sum = sum + scores[j]; }
            for (int64_t j = 0; j < e; ++j) scores[j] = scores[j] / sum;
        } else {
            for (int64_t j = 0; j < e; ++j) {
                double v = (double)x[j];
                if (scoring == 0) scores[j] = sqrtf((float)(v > 20.0 ? v : log1p(exp(v))));
                else scores[j] = (float)(1.0 / (1.0 + exp(-v)));
            }
        }
        int64_t* id = ids + r * k;
        if (hash_ids) {
            for (int64_t i = 0; i < k; ++i) id[i] = hash_ids[r * k + i];
        } else {
            for (int64_t i = 0; i < k; ++i) {
                int64_t best = -1;
                float best_v = 0.0f;
                for (int64_t j = 0; j < e; ++j) {
                    int taken = 0;
                    for (int64_t q = 0; q < i; ++q) if (id[q] == j) { taken = 1; break; }
                    if (taken) continue;
                    float v = scores[j] + (bias ? bias[j] : 0.0f);
                    if (best < 0 || v > best_v) { best = j; best_v = v; }
                }
                id[i] = best;
            }
        }
        for (int64_t i = 1; i < k; ++i) {  /* ascending ids: a fixed summation order */
            int64_t v = id[i], q = i - 1;
            while (q >= 0 && id[q] > v) { id[q + 1] = id[q]; --q; }
            id[q + 1] = v;
        }
        float* w = weights + r * k;
        float sum = 0.0f;
        for (int64_t i = 0; i < k; ++i) { w[i] = scores[id[i]]; sum = sum + w[i]; }
        sum = sum + 1e-20f;
        for (int64_t i = 0; i < k; ++i) w[i] = (w[i] / sum) * scale;
    }
}

/* out[t, :] += sum_j w[t, j] * rows[row_of_pair[t * k + j], :], j in order. */
void moe_combine(float* out, const float* rows, const int64_t* row_of_pair, const float* w,
                 int64_t t_count, int64_t k, int64_t d) {
    for (int64_t t = 0; t < t_count; ++t) {
        float* o = out + t * d;
        for (int64_t c = 0; c < d; ++c) {
            float acc = w[t * k] * rows[row_of_pair[t * k] * d + c];
            for (int64_t j = 1; j < k; ++j) acc = acc + w[t * k + j] * rows[row_of_pair[t * k + j] * d + c];
            o[c] = o[c] + acc;
        }
    }
}

/* out[r, j] = silu(min(g, limit)) * clamp(u, -limit, limit), gate_up rows = [g (m) | u (m)]. */
void swiglu(const float* gate_up, int64_t rows, int64_t m, float limit, float* out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gate_up + r * 2 * m;
        const float* u = g + m;
        float* dst = out + r * m;
        for (int64_t j = 0; j < m; ++j) {
            float gv = g[j] < limit ? g[j] : limit;
            if (g[j] != g[j]) gv = g[j];
            float uv = u[j] < -limit ? -limit : (u[j] > limit ? limit : u[j]);
            float act = gv / (1.0f + expf(-gv));
            dst[j] = act * uv;
        }
    }
}
"""

_lib: ctypes.CDLL | None = None
_tried = False
_enabled = True


def _cache_dir() -> Path:
    from deepinfer import envs

    return Path(envs.get().cache_dir) / "kernels"


def _build() -> ctypes.CDLL | None:
    digest = hashlib.sha256(C_SOURCE.encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_native_{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "cpu_native.c"
            src.write_text(C_SOURCE)
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
    comb_scale: torch.Tensor,
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
    streams = streams.contiguous()
    flat = rms_norm(streams.view(t, n * d), None, norm_eps)
    mixes = torch_ref.linear(flat, fn, batch_invariant).contiguous()
    post = streams.new_empty(t, n)
    comb = streams.new_empty(t, n, n)
    collapsed = streams.new_empty(t, d)
    pp_scale, pp_base = pre_post_scale.float().contiguous(), pre_post_base.float().contiguous()
    comb_base = comb_base.float().contiguous()
    lib.hc_pre(
        _ptr(mixes), _ptr(streams), _ptr(pp_scale), _ptr(pp_base), float(comb_scale), _ptr(comb_base),
        t, n, d, sinkhorn_iters, hc_eps, _ptr(post), _ptr(comb), _ptr(collapsed),
    )  # fmt: skip
    return post, comb, collapsed


def _native_f32(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return library()
    return None


def _rows(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(outer, inner, outer stride, inner stride) of ``x``'s rows, last dim contiguous; None if
    the layout does not fit two levels of rows."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    lib = _native_f32(x) if weight is None or weight.dtype == torch.float32 else None
    rows = _rows(x) if lib is not None else None
    if rows is None:
        return torch_ref.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
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
    lib.swiglu(gate_up.data_ptr(), rows, m, limit, out.data_ptr())
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
