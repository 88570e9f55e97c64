"""Fixed-order CPU GEMMs for float32 weights: ``linear``, ``grouped_linear`` and the routed experts.

Each weight is packed once into 16-column panels (kernels/cpu_gemm_src.py) on first use and the
packed copy is kept on the weight tensor itself (``_cpu_gemm_pack``), tagged with the tensor's
version counter so an in-place update (``load_weights``) repacks it. Every output element is a
single FMA chain in k order, so a row's numbers never depend on the other rows of the call:
these paths are batch-invariant by construction and need no row padding. Callers get ``None``
(or the torch reference) for anything else: other devices or dtypes, no compiler, no AVX2.
"""

from __future__ import annotations

import ctypes

import torch

from deepinfer.kernels import cpu_native, torch_ref

_PANEL = 16
_fast: bool | None = None


def declare(lib: ctypes.CDLL) -> None:
    """ctypes signatures of the GEMM entry points (called by cpu_native when it loads the library)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gemm_packed_size.argtypes = [i64, i64]
    lib.gemm_packed_size.restype = i64
    lib.gemm_pack.argtypes = [p, i64, i64, i64, p]
    lib.gemm.argtypes = [p, i64, i64, i64, p, i64, p, i64]
    lib.gemm_grouped.argtypes = [p, i64, i64, i64, i64, p, i64, i64, p, i64, i64, i64]
    lib.moe_experts.argtypes = [p, i64, p, p, i64, p, i64, p, i64, i64, ctypes.c_float, p, p]
    lib.gemm_has_avx2.restype = i64
    lib.gemm_use_avx2.argtypes = [i64]
    lib.gemm_use_avx2.restype = None
    f32 = ctypes.c_float
    lib.hc_pre_fused.argtypes = [p, p, p, p, f32, p, i64, i64, i64, i64, f32, f32, p, p, p, p]
    lib.swiglu_fast.argtypes = [p, i64, i64, f32, p]
    lib.moe_forward.argtypes = [p, i64, i64, i64, p, i64, p, p, p, i64, i64, f32, p, i64, p, i64, i64, f32, p, p, i64, p]
    lib.moe_forward.restype = i64
    lib.hc_post_pre.argtypes = [p, p, p, p, p, p, p, f32, p, i64, i64, i64, i64, f32, f32, p, f32, p, p, p, p, p]
    lib.hc_post_pre.restype = None
    lib.attention_inputs.argtypes = [p, i64, i64, p, i64, i64, p, p, i64, p, f32, i64, i64, i64, p, p, i64, i64, p, p,
                                     p, p, p, p, p]  # fmt: skip
    lib.attention_inputs.restype = None
    lib.attention_outputs.argtypes = [p, i64, i64, i64, i64, p, p, i64, p, i64, p, i64, p, p]
    lib.attention_outputs.restype = None
    for name in ("gemm_pack", "gemm", "gemm_grouped", "moe_experts", "hc_pre_fused", "swiglu_fast"):
        getattr(lib, name).restype = None


def _library() -> ctypes.CDLL | None:
    """The native library when the fast (AVX2 + FMA) GEMM runs here; the scalar path is exact too
    but slower than MKL, so without AVX2 callers keep torch."""
    global _fast
    lib = cpu_native.library()
    if lib is None:
        return None
    if _fast is None:
        _fast = bool(lib.gemm_has_avx2())
    return lib if _fast else None


def packed_size(n: int, k: int) -> int:
    """Floats of one packed ``[n, k]`` weight (the native ``gemm_packed_size``; tests check both agree)."""
    return -(-n // _PANEL) * k * _PANEL


_INFERENCE = "inference"  # the cache key of an inference tensor's panels


def packed(weight: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
    """Panels of ``weight [..., N, K]`` (leading dims = independent matrices), cached on the tensor."""
    try:
        version = weight._version
    except RuntimeError:
        # an inference tensor has no version counter; weights are not changed after loading, so
        # its panels are cached for good (callers pass ``packed(w).data_ptr()`` to native code:
        # an uncached result would be freed before the call reads it)
        version = _INFERENCE
    cached = getattr(weight, "_cpu_gemm_pack", None)
    if cached is not None and cached[0] == version:
        return cached[1]
    *lead, n, k = weight.shape
    mats = weight.detach().reshape(-1, n, k)
    if mats.stride(-1) != 1:
        mats = mats.contiguous()
    size = packed_size(n, k)
    if cached is not None and cached[1].numel() == mats.shape[0] * size:
        # the weight changed in place (an EP spare buffer refilled by a re-placement): re-pack into
        # its panels, whose pages are already mapped, instead of a fresh allocation faulted in page
        # by page beside the step loop
        out = cached[1]
    else:
        out = torch.empty(mats.shape[0] * size, dtype=torch.float32)
    for g in range(mats.shape[0]):
        mat = mats[g]
        lib.gemm_pack(mat.data_ptr(), n, k, mat.stride(0), out.data_ptr() + g * size * 4)
    weight._cpu_gemm_pack = (version, out)
    return out


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the native GEMMs serve these tensors (CPU float32, library with AVX2 + FMA)."""
    return _usable(*tensors) is not None


def _usable(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    for t in tensors:  # an FP8 weight (kernels/fp8.py) has no dtype: its GEMMs are torch_ref's
        if getattr(t, "dtype", None) is not torch.float32 or not t.is_cpu:
            return None
    return _library()


def linear(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T`` (``torch_ref.linear``'s contract)."""
    shape, w_shape = x.shape, weight.shape  # attribute reads kept few: ~50 calls per decode step
    lib = _usable(x, weight) if len(shape) == 2 and len(w_shape) == 2 else None
    if lib is None or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return torch_ref.linear(x, weight, batch_invariant)
    m, k = shape
    n = w_shape[0]
    if w_shape[1] != k:
        raise ValueError(f"linear: input has {k} features, the weight expects {w_shape[1]}")
    stride = x.stride()
    if stride[1] != 1 or stride[0] < k:
        x = x.contiguous()
        stride = (k, 1)
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        cached = getattr(weight, "_cpu_gemm_pack", None)
        panels = cached[1] if cached is not None and cached[0] is not _INFERENCE and cached[0] == weight._version \
            else packed(weight, lib)
        lib.gemm(x.data_ptr(), m, k, stride[0], panels.data_ptr(), n, y.data_ptr(), n)
    return y


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """Block-diagonal linear ``x [M, G, K]``, ``weight [G, N, K]`` -> ``[M, G, N]`` in one call."""
    lib = _usable(x, weight) if x.dim() == 3 and weight.dim() == 3 else None
    if lib is None:
        return torch_ref.grouped_linear(x, weight, batch_invariant)
    x = x.contiguous()
    m, g, k = x.shape
    n = weight.shape[1]
    y = torch.empty(m, g, n, dtype=torch.float32)
    if m:
        lib.gemm_grouped(x.data_ptr(), m, k, g * k, k, packed(weight, lib).data_ptr(), packed_size(n, k),
                         n, y.data_ptr(), g * n, n, g)  # fmt: skip
    return y


def moe_experts(
    x: torch.Tensor,
    token_of_row: torch.Tensor,
    segments: list[tuple[int, int, int]],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor | None:
    """Routed expert rows ``[num_rows, H]`` in dispatch order (``MoE.compute``'s result) in one
    native call: per segment gather, gate_up GEMM, clamped SwiGLU, down GEMM. ``gate_up
    [E, 2I, H]``, ``down [E, H, I]``. None when the native path does not apply."""
    lib = _usable(x, gate_up, down) if token_of_row.is_cpu else None
    if lib is None or x.dim() != 2:
        return None
    x = x.contiguous()
    h, inter = x.shape[1], down.shape[2]
    num_rows = token_of_row.shape[0]
    out = torch.empty(num_rows, h, dtype=torch.float32)
    if not segments:
        return out
    seg = torch.tensor(segments, dtype=torch.long)
    longest = max(end - first for _, first, end in segments)
    scratch = torch.empty(longest * (h + 3 * inter), dtype=torch.float32)
    token_of_row = token_of_row.contiguous()
    lib.moe_experts(x.data_ptr(), h, token_of_row.data_ptr(), seg.data_ptr(), len(segments),
                    packed(gate_up, lib).data_ptr(), packed_size(2 * inter, h), packed(down, lib).data_ptr(),
                    packed_size(h, inter), inter, limit, scratch.data_ptr(), out.data_ptr())  # fmt: skip
    return out


_SCORING_CODES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


def moe_forward(
    x: torch.Tensor,
    num_tokens: int,
    router: torch.Tensor,
    correction_bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    token_ids: torch.Tensor,
    top_k: int,
    scoring_func: str,
    routed_scaling_factor: float,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
) -> torch.Tensor | None:
    """The whole MoE block of ``x [R, H]`` in one native call (kernels/cpu_moe_src.py): shared
    expert on every row plus the routed experts of the first ``num_tokens`` rows; learned routing
    with ``correction_bias`` or hash routing with ``tid2eid[token_ids]``. None when it does not apply."""
    lib = _usable(x, router, gate_up, down, shared_gate_up, shared_down)
    if lib is None or x.dim() != 2 or scoring_func not in _SCORING_CODES or not token_ids.is_cpu:
        return None
    if router.shape[0] > 1024 or (tid2eid is not None and not tid2eid.is_cpu):  # moe_route's bound
        return None
    x = x.contiguous()
    rows, h = x.shape
    inter, shared_inter = down.shape[2], shared_down.shape[1]
    out = torch.empty(rows, h, dtype=torch.float32)
    bias = 0
    if tid2eid is None:
        bias_t = correction_bias.float().contiguous()
        bias = bias_t.data_ptr()
    hashed = 0 if tid2eid is None else tid2eid.contiguous().data_ptr()
    token_ids = token_ids.contiguous()
    status = lib.moe_forward(
        x.data_ptr(), rows, num_tokens, h, packed(router, lib).data_ptr(), router.shape[0], bias, hashed,
        token_ids.data_ptr(), top_k, _SCORING_CODES[scoring_func], routed_scaling_factor,
        packed(gate_up, lib).data_ptr(), packed_size(2 * inter, h), packed(down, lib).data_ptr(),
        packed_size(h, inter), inter, limit, packed(shared_gate_up, lib).data_ptr(),
        packed(shared_down, lib).data_ptr(), shared_inter, out.data_ptr(),
    )  # fmt: skip
    if status:
        raise MemoryError("moe_forward: out of host memory for its scratch buffers")
    return out


def hc_post_pre(
    block_out: torch.Tensor | None,
    streams: torch.Tensor,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
    hc,
    norm_weight: torch.Tensor,
    norm_eps: float,
):
    """``(streams', post', comb', x)``: streams' = ``hc_post(block_out, streams, post, comb)``
    (``streams`` itself when ``block_out`` is None), the mHC weights of ``hc`` (a finalized
    HyperConnection) on streams' and the next block's input ``x = rms_norm(collapsed,
    norm_weight)``, in one native call, bitwise the separate native ops. None when it does not apply."""
    tensors = (streams, hc.fn, norm_weight) if block_out is None else (streams, hc.fn, norm_weight, block_out, post, comb)
    lib = _usable(*tensors)
    if lib is None or streams.dim() != 3 or streams.shape[1] > 16:
        return None
    rows, n, d = streams.shape
    streams = streams.contiguous()
    new_streams = streams if block_out is None else torch.empty_like(streams)
    post_out = torch.empty(rows, n, dtype=torch.float32)
    comb_out = torch.empty(rows, n, n, dtype=torch.float32)
    x = torch.empty(rows, d, dtype=torch.float32)
    scratch = torch.empty(rows * (n * d + (2 + n) * n + d), dtype=torch.float32)
    if block_out is None:
        out_ptr = post_ptr = comb_ptr = 0
    else:
        block_out, post, comb = block_out.contiguous(), post.contiguous(), comb.contiguous()
        out_ptr, post_ptr, comb_ptr = block_out.data_ptr(), post.data_ptr(), comb.data_ptr()
    lib.hc_post_pre(
        out_ptr, streams.data_ptr(), post_ptr, comb_ptr, packed(hc.fn, lib).data_ptr(), hc.pre_post_scale.data_ptr(),
        hc.pre_post_base.data_ptr(), hc.comb_scale, hc.comb_base.data_ptr(), rows, n, d, hc.sinkhorn_iters,
        hc.norm_eps, hc.hc_eps, norm_weight.contiguous().data_ptr(), norm_eps, scratch.data_ptr(),
        new_streams.data_ptr(), post_out.data_ptr(), comb_out.data_ptr(), x.data_ptr(),
    )  # fmt: skip
    return new_streams, post_out, comb_out, x


def attention_inputs(
    h: torch.Tensor,
    w_in: torch.Tensor,
    q_rank: int,
    q_norm: torch.Tensor,
    w_qb: torch.Tensor,
    kv_norm: torch.Tensor,
    eps: float,
    num_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    index_heads: int = 0,
    index_head_dim: int = 0,
    index_cos: torch.Tensor | None = None,
    index_sin: torch.Tensor | None = None,
):
    """(proj, q_all, q, kv) of a V4 attention layer in one native call (kernels/cpu_gemm_src.py),
    bitwise the separate native ops: ``proj = h @ w_in.T``; ``q_all = rms_norm(proj[:, :q_rank],
    q_norm) @ w_qb.T``; ``q`` its first ``num_heads`` heads normed and rotated; ``kv`` the kv
    columns normed and rotated; the indexer's query heads in ``q_all`` rotated in place with the
    index tables. None when it does not apply."""
    tables = (cos, sin) if index_cos is None else (cos, sin, index_cos, index_sin)
    lib = _usable(h, w_in, q_norm, w_qb, kv_norm, *tables)
    if lib is None or h.dim() != 2 or not all(t.is_contiguous() for t in tables) or cos.shape[0] != h.shape[0]:
        return None
    h = h.contiguous()
    rows, hidden = h.shape
    n_in, n_qb, rd = w_in.shape[0], w_qb.shape[0], cos.shape[1]
    proj = torch.empty(rows, n_in, dtype=torch.float32)
    q_all = torch.empty(rows, n_qb, dtype=torch.float32)
    q = torch.empty(rows, num_heads, head_dim, dtype=torch.float32)
    kv = torch.empty(rows, head_dim, dtype=torch.float32)
    scratch = torch.empty(rows * q_rank, dtype=torch.float32)
    icos = isin = 0
    if index_cos is not None:
        icos, isin = index_cos.data_ptr(), index_sin.data_ptr()
    lib.attention_inputs(
        h.data_ptr(), rows, hidden, packed(w_in, lib).data_ptr(), n_in, q_rank, q_norm.contiguous().data_ptr(),
        packed(w_qb, lib).data_ptr(), n_qb, kv_norm.contiguous().data_ptr(), eps, num_heads, head_dim, rd,
        cos.data_ptr(), sin.data_ptr(), index_heads, index_head_dim, icos, isin, scratch.data_ptr(),
        proj.data_ptr(), q_all.data_ptr(), q.data_ptr(), kv.data_ptr(),
    )  # fmt: skip
    return proj, q_all, q, kv


def attention_outputs(
    out: torch.Tensor, cos: torch.Tensor, neg_sin: torch.Tensor, w_o_a: torch.Tensor, w_o_b: torch.Tensor
) -> torch.Tensor | None:
    """``o_b(grouped o_a(unrotate(out)))`` of a V4 attention layer in one native call, bitwise the
    separate native ops; ``out [R, nh, hd]`` is un-rotated in place. ``w_o_a [G, rank, nh * hd / G]``,
    ``w_o_b [hidden, G * rank]``. None when it does not apply."""
    lib = _usable(out, cos, neg_sin, w_o_a, w_o_b)
    if lib is None or out.dim() != 3 or not (out.is_contiguous() and cos.is_contiguous() and neg_sin.is_contiguous()):
        return None
    rows, nh, hd = out.shape
    groups, rank = w_o_a.shape[0], w_o_a.shape[1]
    hidden = w_o_b.shape[0]
    if cos.shape[0] != rows:
        return None
    mixed = torch.empty(rows, groups * rank, dtype=torch.float32)
    y = torch.empty(rows, hidden, dtype=torch.float32)
    lib.attention_outputs(out.data_ptr(), rows, nh, hd, cos.shape[1], cos.data_ptr(), neg_sin.data_ptr(), groups,
                          packed(w_o_a, lib).data_ptr(), rank, packed(w_o_b, lib).data_ptr(), hidden,
                          mixed.data_ptr(), y.data_ptr())  # fmt: skip
    return y
