"""C source of the fixed-order CPU GEMM (kernels/cpu_gemm.py wraps it; cpu_native.py compiles it).

``y = x @ W.T`` with ``W [N, K]`` packed once into column panels ``[ceil(N/16), K, 16]`` (zero
padded). Every output element is one FMA chain over k = 0 .. K-1 starting from zero, whichever
micro-kernel (4 rows or 1 row) computes it and wherever its row sits: a row's numbers depend on
that row alone (batch-invariant for any M, no row padding needed), and the AVX2 path and the
scalar ``fmaf`` path give bitwise the same results. Measured on the 2-core AMD EPYC dev box
(AVX2, 1 thread): ~35 GFLOP/s at M = 2048 (MKL sgemm: ~31), and 1.5-2x MKL at decode sizes
(M = 4-16), where MKL's small-M path streams the weights slowly.
"""

GEMM_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

#define PANEL 16

/* floats of one packed [n, k] matrix (cpu_gemm.packed_size): ceil(n / 16) panels of k x 16.
   The ceiling is spelled out: C's division truncates, so Python's -(-n // 16) idiom floors here. */
int64_t gemm_packed_size(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * k * PANEL; }

/* w [n, k] (row stride ldw) -> panels [ceil(n/16)][k][16], zero padded */
void gemm_pack(const float* w, int64_t n, int64_t k, int64_t ldw, float* out) {
    int64_t np = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < np; ++p)
        for (int64_t kk = 0; kk < k; ++kk)
            for (int j = 0; j < PANEL; ++j) {
                int64_t col = p * PANEL + j;
                out[(p * k + kk) * PANEL + j] = col < n ? w[col * ldw + kk] : 0.0f;
            }
}

/* the portable path: the same FMA chain per element as the AVX2 kernels */
static void tile_scalar(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t k, float* y,
                        int64_t ldy, int64_t ncols) {
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < ncols; ++j) {
            float acc = 0.0f;
            for (int64_t kk = 0; kk < k; ++kk) acc = fmaf(x[i * ldx + kk], w[kk * PANEL + j], acc);
            y[i * ldy + j] = acc;
        }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_GEMM 1

/* panels stream from memory at decode sizes: ask for the line this many k steps ahead
   (prefetches past the end are harmless hints) */
#define PREFETCH_AHEAD 64
#define ACC(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps();
#define FMA_ROW(i) a = _mm256_broadcast_ss(x + (i) * ldx + kk); \
    c##i##0 = _mm256_fmadd_ps(a, w0, c##i##0); c##i##1 = _mm256_fmadd_ps(a, w1, c##i##1);
#define FMA_HALF(i) a = _mm256_broadcast_ss(x + (i) * ldx + kk); c##i##0 = _mm256_fmadd_ps(a, w0, c##i##0);
#define STORE_ROW(i) if (ncols == PANEL) { \
        _mm256_storeu_ps(y + (i) * ldy, c##i##0); _mm256_storeu_ps(y + (i) * ldy + 8, c##i##1); \
    } else { \
        float t[PANEL]; _mm256_storeu_ps(t, c##i##0); _mm256_storeu_ps(t + 8, c##i##1); \
        memcpy(y + (i) * ldy, t, (size_t)ncols * sizeof(float)); \
    }

__attribute__((target("avx2,fma")))
static void tile4(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy, int64_t ncols) {
    ACC(0) ACC(1) ACC(2) ACC(3)
    if (ncols <= 8) {  /* a half panel (N % 16 <= 8): the zero columns cost nothing */
        for (int64_t kk = 0; kk < k; ++kk) {
            _mm_prefetch((const char*)(w + (kk + PREFETCH_AHEAD) * PANEL), _MM_HINT_T0);
            __m256 w0 = _mm256_loadu_ps(w + kk * PANEL), a;
            FMA_HALF(0) FMA_HALF(1) FMA_HALF(2) FMA_HALF(3)
        }
    } else {
        for (int64_t kk = 0; kk < k; ++kk) {
            _mm_prefetch((const char*)(w + (kk + PREFETCH_AHEAD) * PANEL), _MM_HINT_T0);
            __m256 w0 = _mm256_loadu_ps(w + kk * PANEL), w1 = _mm256_loadu_ps(w + kk * PANEL + 8), a;
            FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3)
        }
    }
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3)
}

__attribute__((target("avx2,fma")))
static void tile6(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy, int64_t ncols) {
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5)
    if (ncols <= 8) {  /* a half panel (N % 16 <= 8): the zero columns cost nothing */
        for (int64_t kk = 0; kk < k; ++kk) {
            _mm_prefetch((const char*)(w + (kk + PREFETCH_AHEAD) * PANEL), _MM_HINT_T0);
            __m256 w0 = _mm256_loadu_ps(w + kk * PANEL), a;
            FMA_HALF(0) FMA_HALF(1) FMA_HALF(2) FMA_HALF(3) FMA_HALF(4) FMA_HALF(5)
        }
    } else {
        for (int64_t kk = 0; kk < k; ++kk) {
            _mm_prefetch((const char*)(w + (kk + PREFETCH_AHEAD) * PANEL), _MM_HINT_T0);
            __m256 w0 = _mm256_loadu_ps(w + kk * PANEL), w1 = _mm256_loadu_ps(w + kk * PANEL + 8), a;
            FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5)
        }
    }
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
}

__attribute__((target("avx2,fma")))
static void tile1(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy, int64_t ncols) {
    ACC(0)
    if (ncols <= 8) {  /* a half panel (N % 16 <= 8): the zero columns cost nothing */
        for (int64_t kk = 0; kk < k; ++kk) {
            _mm_prefetch((const char*)(w + (kk + PREFETCH_AHEAD) * PANEL), _MM_HINT_T0);
            __m256 w0 = _mm256_loadu_ps(w + kk * PANEL), a;
            FMA_HALF(0)
        }
    } else {
        for (int64_t kk = 0; kk < k; ++kk) {
            _mm_prefetch((const char*)(w + (kk + PREFETCH_AHEAD) * PANEL), _MM_HINT_T0);
            __m256 w0 = _mm256_loadu_ps(w + kk * PANEL), w1 = _mm256_loadu_ps(w + kk * PANEL + 8), a;
            FMA_ROW(0)
        }
    }
    STORE_ROW(0)
}
#endif

int64_t gemm_has_avx2(void) {
#ifdef HAVE_AVX2_GEMM
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ W.T, W packed by gemm_pack. Rows run in
   blocks of 48 so a block's inputs stay in L2 while every panel streams past them once. */
static int64_t fast = -1;

/* 0: force the portable path (tests compare it with the AVX2 one), 1: AVX2 when the CPU has it */
void gemm_use_avx2(int64_t on) { fast = on ? gemm_has_avx2() : 0; }

void gemm(const float* x, int64_t m, int64_t k, int64_t ldx, const float* wp, int64_t n, float* y, int64_t ldy) {
    if (fast < 0) fast = gemm_has_avx2();
    int64_t np = (n + PANEL - 1) / PANEL;
    for (int64_t m0 = 0; m0 < m; m0 += 48) {
        int64_t m1 = m0 + 48 < m ? m0 + 48 : m;
        for (int64_t p = 0; p < np; ++p) {
            int64_t ncols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
            const float* w = wp + p * k * PANEL;
            float* yp = y + p * PANEL;
            int64_t i = m0;
#ifdef HAVE_AVX2_GEMM
            if (fast) {
                for (; i + 6 <= m1; i += 6) tile6(x + i * ldx, ldx, w, k, yp + i * ldy, ldy, ncols);
                for (; i + 4 <= m1; i += 4) tile4(x + i * ldx, ldx, w, k, yp + i * ldy, ldy, ncols);
                for (; i < m1; ++i) tile1(x + i * ldx, ldx, w, k, yp + i * ldy, ldy, ncols);
            }
#endif
            tile_scalar(m1 - i, x + i * ldx, ldx, w, k, yp + i * ldy, ldy, ncols);
        }
    }
}

/* `groups` independent GEMMs: group g reads x + g * gx, weights wp + g * gw, writes y + g * gy */
void gemm_grouped(const float* x, int64_t m, int64_t k, int64_t ldx, int64_t gx, const float* wp, int64_t gw,
                  int64_t n, float* y, int64_t ldy, int64_t gy, int64_t groups) {
    for (int64_t g = 0; g < groups; ++g) gemm(x + g * gx, m, k, ldx, wp + g * gw, n, y + g * gy, ldy);
}

/* mHC block weights in one call (defined in the main source: rms_norm, hc_pre): the unweighted
   RMSNorm of the flattened streams, their mixes with the packed fn, then post / comb / collapse.
   scratch: rows * (n * d + (2 + n) * n) floats. */
void rms_norm(const float* x, int64_t outer, int64_t inner, int64_t so, int64_t si, int64_t d,
              const float* weight, float eps, float* out);
void hc_pre(const float* mixes, const float* streams, const float* pp_scale, const float* pp_base,
            float comb_scale, const float* comb_base, int64_t rows, int64_t n, int64_t d,
            int64_t iters, float hc_eps, float* post, float* comb, float* collapsed);

#ifdef HAVE_AVX2_GEMM
/* the same loop on 8 rows at once (row r in lane r): per lane the very same adds and divisions */
__attribute__((target("avx2,fma")))
static void sinkhorn8(float* comb, int64_t n, int64_t iters, float eps) {
    __m256 c[256];
    int64_t nn = n * n;
    for (int64_t e = 0; e < nn; ++e)
        c[e] = _mm256_set_ps(comb[7 * nn + e], comb[6 * nn + e], comb[5 * nn + e], comb[4 * nn + e],
                             comb[3 * nn + e], comb[2 * nn + e], comb[nn + e], comb[e]);
    __m256 veps = _mm256_set1_ps(eps);
    for (int64_t it = 0; it < iters; ++it) {
        if (it > 0) {
            for (int64_t i = 0; i < n; ++i) {
                __m256 s = c[i * n];
                for (int64_t j = 1; j < n; ++j) s = _mm256_add_ps(s, c[i * n + j]);
                s = _mm256_add_ps(s, veps);
                for (int64_t j = 0; j < n; ++j) c[i * n + j] = _mm256_div_ps(c[i * n + j], s);
            }
        }
        for (int64_t j = 0; j < n; ++j) {
            __m256 s = c[j];
            for (int64_t i = 1; i < n; ++i) s = _mm256_add_ps(s, c[i * n + j]);
            s = _mm256_add_ps(s, veps);
            for (int64_t i = 0; i < n; ++i) c[i * n + j] = _mm256_div_ps(c[i * n + j], s);
        }
    }
    for (int64_t e = 0; e < nn; ++e) {
        float lanes[8];
        _mm256_storeu_ps(lanes, c[e]);
        for (int r = 0; r < 8; ++r) comb[r * nn + e] = lanes[r];
    }
}
#endif

void hc_pre_fused(const float* streams, const float* fn_packed, const float* pp_scale, const float* pp_base,
                  float comb_scale, const float* comb_base, int64_t rows, int64_t n, int64_t d, int64_t iters,
                  float norm_eps, float hc_eps, float* scratch, float* post, float* comb, float* collapsed) {
    float* flat = scratch;
    float* mixes = flat + rows * n * d;
    int64_t width = (2 + n) * n;
    rms_norm(streams, rows, 1, n * d, 0, n * d, 0, norm_eps, flat);
    gemm(flat, rows, n * d, n * d, fn_packed, width, mixes, width);
    /* weights and collapse without the Sinkhorn rounds, which then run 8 rows at a time */
    hc_pre(mixes, streams, pp_scale, pp_base, comb_scale, comb_base, rows, n, d, 0, hc_eps, post, comb, collapsed);
    int64_t r = 0;
#ifdef HAVE_AVX2_GEMM
    if (fast < 0) fast = gemm_has_avx2();
    if (fast && n <= 16)
        for (; r + 8 <= rows; r += 8) sinkhorn8(comb + r * n * n, n, iters, hc_eps);
#endif
    for (; r < rows; ++r) sinkhorn_row(comb + r * n * n, n, iters, hc_eps);
}

/* New streams and the next block's input in one call: streams' = hc_post(block_out, streams, post,
   comb) (skipped when block_out is NULL: streams' = streams), then hc_pre_fused on streams' and the
   block input x = rms_norm(collapsed, norm_weight). new_streams may be NULL when block_out is. */
void hc_post(const float* out, const float* streams, const float* post, const float* comb, int64_t rows,
             int64_t n, int64_t d, float* result);

void hc_post_pre(const float* block_out, const float* streams, const float* post, const float* comb,
                 const float* fn_packed, const float* pp_scale, const float* pp_base, float comb_scale,
                 const float* comb_base, int64_t rows, int64_t n, int64_t d, int64_t iters, float norm_eps,
                 float hc_eps, const float* norm_weight, float block_eps, float* scratch, float* new_streams,
                 float* post_out, float* comb_out, float* x_out) {
    const float* src = streams;
    if (block_out) {
        hc_post(block_out, streams, post, comb, rows, n, d, new_streams);
        src = new_streams;
    }
    float* collapsed = scratch + rows * (n * d + (2 + n) * n);
    hc_pre_fused(src, fn_packed, pp_scale, pp_base, comb_scale, comb_base, rows, n, d, iters, norm_eps, hc_eps,
                 scratch, post_out, comb_out, collapsed);
    rms_norm(collapsed, rows, 1, d, 0, d, norm_weight, block_eps, x_out);
}


/* V4 attention inputs in one call (engine/models/deepseek_v4/attention.py, same kernels in the
   same order): proj = h @ w_in.T [rows, n_in] (q_a | kv | compressor and indexer columns);
   q_all = rms_norm(proj[:, :q_rank], q_norm) @ w_qb.T [rows, n_qb]; q = rope(rms_norm(q_all
   heads)) [rows, nh, hd]; kv = rope(rms_norm(proj[:, q_rank : q_rank + hd], kv_norm)) [rows, hd];
   the indexer's query heads (q_all columns past nh * hd, ih x ihd) rotated in place with the
   compress tables when ih > 0. cos/sin [rows, rd]. scratch: rows * q_rank floats. */
void rope(float* x, int64_t outer, int64_t inner, int64_t so, int64_t si, int64_t d, int64_t rd,
          const float* cos_t, const float* sin_t);

void attention_inputs(const float* h, int64_t rows, int64_t hidden, const float* w_in, int64_t n_in,
                      int64_t q_rank, const float* q_norm, const float* w_qb, int64_t n_qb, const float* kv_norm,
                      float eps, int64_t nh, int64_t hd, int64_t rd, const float* cos_t, const float* sin_t,
                      int64_t ih, int64_t ihd, const float* icos, const float* isin, float* scratch, float* proj,
                      float* q_all, float* q, float* kv) {
    gemm(h, rows, hidden, hidden, w_in, n_in, proj, n_in);
    rms_norm(proj, rows, 1, n_in, 0, q_rank, q_norm, eps, scratch);
    gemm(scratch, rows, q_rank, q_rank, w_qb, n_qb, q_all, n_qb);
    rms_norm(q_all, rows, nh, n_qb, hd, hd, 0, eps, q);
    rope(q, rows, nh, nh * hd, hd, hd, rd, cos_t, sin_t);
    rms_norm(proj + q_rank, rows, 1, n_in, 0, hd, kv_norm, eps, kv);
    rope(kv, rows, 1, hd, 0, hd, rd, cos_t, sin_t);
    if (ih > 0) rope(q_all + nh * hd, rows, ih, n_qb, ihd, ihd, rd, icos, isin);
}

/* V4 attention output in one call: undo the rotation of the attention output out [rows, nh, hd]
   in place (neg_sin), the grouped low-rank o_a (groups of nh * hd / groups channels) into
   mixed [rows, groups * rank], then o_b into y [rows, hidden]. */
void attention_outputs(float* out, int64_t rows, int64_t nh, int64_t hd, int64_t rd, const float* cos_t,
                       const float* neg_sin, int64_t groups, const float* w_oa, int64_t rank, const float* w_ob,
                       int64_t hidden, float* mixed, float* y) {
    rope(out, rows, nh, nh * hd, hd, hd, rd, cos_t, neg_sin);
    int64_t k = nh * hd / groups;
    gemm_grouped(out, rows, k, groups * k, k, w_oa, gemm_packed_size(rank, k), rank, mixed, groups * rank, rank,
                 groups);
    gemm(mixed, rows, groups * rank, groups * rank, w_ob, hidden, y, hidden);
}

/* silu(min(g, limit)) * clamp(u, -limit, limit) of rows [g (m) | u (m)] (defined in the main source) */
void swiglu(const float* gate_up, int64_t rows, int64_t m, float limit, float* out);

#ifdef HAVE_AVX2_GEMM
__attribute__((target("avx2,fma")))
static inline __m256 swiglu8(__m256 g, __m256 u, __m256 lim, __m256 neg_lim) {
    __m256 gv = _mm256_blendv_ps(_mm256_min_ps(g, lim), g, _mm256_cmp_ps(g, g, _CMP_UNORD_Q));  /* NaN stays */
    __m256 uv = _mm256_blendv_ps(_mm256_min_ps(_mm256_max_ps(u, neg_lim), lim), u, _mm256_cmp_ps(u, u, _CMP_UNORD_Q));
    __m256 act = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    return _mm256_mul_ps(act, uv);
}

/* the SIMD SwiGLU: exp8 on 8 channels at a time, a ragged tail through a padded vector, so
   every element gets the same instructions wherever it sits */
__attribute__((target("avx2,fma")))
static void swiglu_avx2(const float* gate_up, int64_t rows, int64_t m, float limit, float* out) {
    __m256 lim = _mm256_set1_ps(limit), neg_lim = _mm256_set1_ps(-limit);
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gate_up + r * 2 * m;
        const float* u = g + m;
        float* dst = out + r * m;
        int64_t j = 0;
        for (; j + 8 <= m; j += 8)
            _mm256_storeu_ps(dst + j, swiglu8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j), lim, neg_lim));
        if (j < m) {
            float gt[8] = {0}, ut[8] = {0}, ot[8];
            memcpy(gt, g + j, (size_t)(m - j) * sizeof(float));
            memcpy(ut, u + j, (size_t)(m - j) * sizeof(float));
            _mm256_storeu_ps(ot, swiglu8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut), lim, neg_lim));
            memcpy(dst + j, ot, (size_t)(m - j) * sizeof(float));
        }
    }
}
#endif

/* SwiGLU through the SIMD path when the CPU has it (the numbers then differ from the scalar
   kernel by the exp polynomial, the same on every call of this machine) */
void swiglu_fast(const float* gate_up, int64_t rows, int64_t m, float limit, float* out) {
#ifdef HAVE_AVX2_GEMM
    if (fast < 0) fast = gemm_has_avx2();
    if (fast) { swiglu_avx2(gate_up, rows, m, limit, out); return; }
#endif
    swiglu(gate_up, rows, m, limit, out);
}

/* Routed experts over a dispatch plan: for each segment (expert, first, end) gather the token
   rows x[token_of_row[first..end)], run gate_up -> clamped SwiGLU -> down with the expert's
   packed weights and write out[first..end). scratch: rows * (h + 3 * inter) floats, rows the
   longest segment. */
void moe_experts(const float* x, int64_t h, const int64_t* token_of_row, const int64_t* seg, int64_t num_seg,
                 const float* gate_up, int64_t gate_up_stride, const float* down, int64_t down_stride,
                 int64_t inter, float limit, float* scratch, float* out) {
    for (int64_t s = 0; s < num_seg; ++s) {
        int64_t e = seg[3 * s], first = seg[3 * s + 1], rows = seg[3 * s + 2] - first;
        float* gathered = scratch;
        float* hidden = gathered + rows * h;
        float* act = hidden + rows * 2 * inter;
        for (int64_t r = 0; r < rows; ++r)
            memcpy(gathered + r * h, x + token_of_row[first + r] * h, (size_t)h * sizeof(float));
        gemm(gathered, rows, h, h, gate_up + e * gate_up_stride, 2 * inter, hidden, 2 * inter);
        swiglu_fast(hidden, rows, inter, limit, act);
        gemm(act, rows, inter, inter, down + e * down_stride, h, out + first * h, h);
    }
}
"""
