"""C source of the AVX2 + FMA gathered attention (kernels/cpu_native.py compiles and picks it).

Same contract as ``gathered_attention`` in cpu_native_src.py (one token at a time, key rows read
in place by id, -inf keys skipped, the sink slot's logit from ``sinks``), organised for SIMD:

  scores   8 heads per key at once: per head 8 channel lanes (FMA chains over the d / 8 channel
           blocks) reduced by one fixed tree, giving a vector with the 8 heads as lanes
  softmax  per head over [valid window keys, sink, valid extra keys] in that order; exp is a
           fixed polynomial evaluated on whole 8-head vectors (no libm, no tails)
  output   per channel one FMA chain over the valid keys in order, run in L1-sized key blocks
           with two heads x 32 channels in registers (each key load feeds both heads)

Every number of a token comes from that token's inputs through the same instruction sequence,
so tokens stand alone (batch-invariant). Results match the scalar kernel to a few ulp (FMA, a
different summation order and the polynomial exp).
"""

ATTENTION_SOURCE = r"""
#include <string.h>

/* ring[rows[i]] = fresh[src[i]] (fresh rows ld_fresh apart, width floats each), i in order */
void ring_write(float* ring, const int64_t* rows, const int64_t* src, int64_t n, const float* fresh,
                int64_t ld_fresh, int64_t width) {
    for (int64_t i = 0; i < n; ++i)
        memcpy(ring + rows[i] * width, fresh + src[i] * ld_fresh, (size_t)width * sizeof(float));
}

/* An attention layer's window pool (engine/models/deepseek_v4/context.py): pool = [ring rows
   ring_rows | the nf fresh rows | one zero row (the sink)], gathered before the fresh rows are
   written to the ring (write_rows / write_src, as ring_write). */
void window_pool(float* ring, const int64_t* ring_rows, int64_t nr, const float* fresh, int64_t nf, int64_t width,
                 const int64_t* write_rows, const int64_t* write_src, int64_t nw, float* pool) {
    size_t row = (size_t)width * sizeof(float);
    for (int64_t i = 0; i < nr; ++i) memcpy(pool + i * width, ring + ring_rows[i] * width, row);
    memcpy(pool + nr * width, fresh, (size_t)nf * row);
    memset(pool + (nr + nf) * width, 0, row);
    ring_write(ring, write_rows, write_src, nw, fresh, width, width);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <stdlib.h>

/* exp on 8 lanes: Cephes-style range reduction (ln 2 in two parts) and a degree-6 polynomial;
   inputs are clamped to [-87.3, 88.3], so -inf gives the smallest normal's neighbour (~1e-38),
   which the callers never feed (masked keys are dropped before the softmax). */
__attribute__((target("avx2,fma")))
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* sc[hb .. hb + 8) = q_{hb+lane} . key for 8 heads: per head 8 channel lanes, each an FMA chain
   over the d / 8 channel blocks, then one fixed tree across the lanes (hadd pairs, then the two
   128-bit halves). qp [hp][d]: the token's q, heads padded with zero rows. */
__attribute__((target("avx2,fma")))
static inline __m256 score_heads8(const float* qp, int64_t d, const float* key) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t c = 0; c < d; c += 8) {
        __m256 kv = _mm256_loadu_ps(key + c);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + 0 * d + c), kv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + 1 * d + c), kv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + 2 * d + c), kv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + 3 * d + c), kv, a3);
        a4 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + 4 * d + c), kv, a4);
        a5 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + 5 * d + c), kv, a5);
        a6 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + 6 * d + c), kv, a6);
        a7 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + 7 * d + c), kv, a7);
    }
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#define PV_BLOCK 32  /* keys per L1-resident block of the output pass (32 keys x 64 ch = 8 KB) */

/* o[0..8*nj) (+)= sum_n p[n * hp] * keys[n][c0 ..], one FMA chain per channel over n in order */
__attribute__((target("avx2,fma")))
static void weigh_keys(const float* p, int64_t hp, const float* const* keys, int64_t nv, int64_t c0, int64_t nj,
                       int is_first, float* o) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = is_first || j >= nj ? _mm256_setzero_ps() : _mm256_loadu_ps(o + 8 * j);
    if (nj == 8) {
        for (int64_t n = 0; n < nv; ++n) {
            __m256 w = _mm256_broadcast_ss(p + n * hp);
            const float* key = keys[n] + c0;
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(key + 8 * j), acc[j]);
        }
    } else {
        for (int64_t n = 0; n < nv; ++n) {
            __m256 w = _mm256_broadcast_ss(p + n * hp);
            const float* key = keys[n] + c0;
            for (int j = 0; j < nj; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(key + 8 * j), acc[j]);
        }
    }
    for (int j = 0; j < nj; ++j) _mm256_storeu_ps(o + 8 * j, acc[j]);
}

/* the same chains for two heads and 32 channels at once: each key's 4 loads feed 8 FMAs */
__attribute__((target("avx2,fma")))
static void weigh_keys2(const float* p, int64_t hp, const float* const* keys, int64_t nv, int64_t c0,
                        int is_first, float* o0, float* o1) {
    __m256 a0, a1, a2, a3, b0, b1, b2, b3;
    if (is_first) {
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = _mm256_setzero_ps();
    } else {
        a0 = _mm256_loadu_ps(o0); a1 = _mm256_loadu_ps(o0 + 8); a2 = _mm256_loadu_ps(o0 + 16); a3 = _mm256_loadu_ps(o0 + 24);
        b0 = _mm256_loadu_ps(o1); b1 = _mm256_loadu_ps(o1 + 8); b2 = _mm256_loadu_ps(o1 + 16); b3 = _mm256_loadu_ps(o1 + 24);
    }
    for (int64_t n = 0; n < nv; ++n) {
        __m256 wa = _mm256_broadcast_ss(p + n * hp), wb = _mm256_broadcast_ss(p + n * hp + 1);
        const float* key = keys[n] + c0;
        __m256 k0 = _mm256_loadu_ps(key), k1 = _mm256_loadu_ps(key + 8);
        __m256 k2 = _mm256_loadu_ps(key + 16), k3 = _mm256_loadu_ps(key + 24);
        a0 = _mm256_fmadd_ps(wa, k0, a0); a1 = _mm256_fmadd_ps(wa, k1, a1);
        a2 = _mm256_fmadd_ps(wa, k2, a2); a3 = _mm256_fmadd_ps(wa, k3, a3);
        b0 = _mm256_fmadd_ps(wb, k0, b0); b1 = _mm256_fmadd_ps(wb, k1, b1);
        b2 = _mm256_fmadd_ps(wb, k2, b2); b3 = _mm256_fmadd_ps(wb, k3, b3);
    }
    _mm256_storeu_ps(o0, a0); _mm256_storeu_ps(o0 + 8, a1); _mm256_storeu_ps(o0 + 16, a2); _mm256_storeu_ps(o0 + 24, a3);
    _mm256_storeu_ps(o1, b0); _mm256_storeu_ps(o1 + 8, b1); _mm256_storeu_ps(o1 + 16, b2); _mm256_storeu_ps(o1 + 24, b3);
}

/* scratch: (np + ne) * (hp + 3) + d * hp floats, hp = h rounded up to 8. Pool row r is
   pool + r * d, or row_ptrs[r] when row_ptrs is given (a pool that is never materialised). */
__attribute__((target("avx2,fma")))
static void attention_core(const float* q, const float* pool, const float* const* row_ptrs, const int64_t* pool_rows,
                           const float* pool_bias, int64_t np, const float* extra, const int64_t* extra_rows,
                           const float* extra_bias, int64_t ne, const float* sinks, int64_t g, int64_t h, int64_t d,
                           float scale, float* scratch, float* out) {
    int64_t n_all = np + ne, hp = (h + 7) / 8 * 8;
    const float** keys = (const float**)scratch;  /* [n_all] key row pointers (2 floats each) */
    float* sc = scratch + 2 * n_all;               /* [n_all][hp] scores, then probabilities */
    float* qp = sc + n_all * hp;                   /* [hp][d] the token's q, zero rows past h */
    float* bias = qp + d * hp;                     /* [n_all] */
    float sink_lane[hp];
    for (int64_t hh = 0; hh < hp; ++hh) sink_lane[hh] = hh < h ? sinks[hh] : 0.0f;
    for (int64_t i = 0; i < g; ++i) {
        /* the token's valid keys in order, the sink (a zero row) left out: it sits after the
           `num_window` window keys in the softmax and adds nothing to the output */
        int64_t nv = 0, num_window = 0;
        for (int64_t n = 0; n < n_all; ++n) {
            if (n == np - 1) { num_window = nv; continue; }
            float b = n < np ? pool_bias[i * np + n] : extra_bias[i * ne + (n - np)];
            if (b == -INFINITY) continue;
            if (n >= np) keys[nv] = extra + extra_rows[i * ne + (n - np)] * d;
            else keys[nv] = row_ptrs ? row_ptrs[pool_rows[i * np + n]] : pool + pool_rows[i * np + n] * d;
            bias[nv++] = b;
        }
        const float* qi = q + i * h * d;
        for (int64_t hh = 0; hh < hp; ++hh)
            for (int64_t k = 0; k < d; ++k) qp[hh * d + k] = hh < h ? qi[hh * d + k] : 0.0f;
        __m256 vscale = _mm256_set1_ps(scale);
        for (int64_t hb = 0; hb < hp; hb += 8) {
            for (int64_t n = 0; n < nv; ++n) _mm256_storeu_ps(sc + n * hp + hb, score_heads8(qp + hb * d, d, keys[n]));
            __m256 sink = _mm256_loadu_ps(sink_lane + hb), mx = sink;
            for (int64_t n = 0; n < nv; ++n) {
                __m256 s = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(sc + n * hp + hb), vscale),
                                         _mm256_set1_ps(bias[n]));
                _mm256_storeu_ps(sc + n * hp + hb, s);
                mx = _mm256_max_ps(mx, s);
            }
            __m256 sum = _mm256_setzero_ps();
            for (int64_t n = 0; n <= nv; ++n) {
                if (n == num_window) sum = _mm256_add_ps(sum, exp8(_mm256_sub_ps(sink, mx)));
                if (n == nv) break;
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + n * hp + hb), mx));
                _mm256_storeu_ps(sc + n * hp + hb, e);
                sum = _mm256_add_ps(sum, e);
            }
            for (int64_t n = 0; n < nv; ++n)
                _mm256_storeu_ps(sc + n * hp + hb, _mm256_div_ps(_mm256_loadu_ps(sc + n * hp + hb), sum));
        }
        /* keys in blocks that stay in L1 while every head passes over them; each channel's
           chain continues through `out` from block to block, so the order is still n ascending */
        float* oi = out + i * h * d;
        for (int64_t n0 = 0; n0 == 0 || n0 < nv; n0 += PV_BLOCK) {
            int64_t cnt = nv - n0 < PV_BLOCK ? nv - n0 : PV_BLOCK;
            if (h % 2 == 0 && d % 32 == 0) {
                for (int64_t hh = 0; hh < h; hh += 2)
                    for (int64_t c0 = 0; c0 < d; c0 += 32)
                        weigh_keys2(sc + n0 * hp + hh, hp, keys + n0, cnt, c0, n0 == 0, oi + hh * d + c0,
                                    oi + (hh + 1) * d + c0);
                continue;
            }
            for (int64_t hh = 0; hh < h; ++hh)
                for (int64_t c0 = 0; c0 < d; c0 += 64) {
                    int64_t nj = (d - c0 < 64 ? d - c0 : 64) / 8;
                    weigh_keys(sc + n0 * hp + hh, hp, keys + n0, cnt, c0, nj, n0 == 0, oi + hh * d + c0);
                }
        }
    }
}
__attribute__((target("avx2,fma")))
void gathered_attention_avx2(const float* q, const float* pool, const int64_t* pool_rows, const float* pool_bias,
                             int64_t np, const float* extra, const int64_t* extra_rows, const float* extra_bias,
                             int64_t ne, const float* sinks, int64_t g, int64_t h, int64_t d, float scale,
                             float* scratch, float* out) {
    attention_core(q, pool, 0, pool_rows, pool_bias, np, extra, extra_rows, extra_bias, ne, sinks, g, h, d, scale,
                   scratch, out);
}

/* gathered_attention_avx2 over the window pool of window_pool() without building it: pool row r
   is ring row ring_rows[r] (r < nr), fresh row r - nr (r < nr + nf), or the zero sink row. The
   caller writes the fresh rows to the ring afterwards. Returns -1 when memory ran out. */
__attribute__((target("avx2,fma")))
int64_t window_attention_avx2(const float* q, const float* ring, const int64_t* ring_rows, int64_t nr,
                              const float* fresh, int64_t nf, const int64_t* pool_rows, const float* pool_bias,
                              int64_t np, const float* extra, const int64_t* extra_rows, const float* extra_bias,
                              int64_t ne, const float* sinks, int64_t g, int64_t h, int64_t d, float scale,
                              float* scratch, float* out) {
    const float** ptrs = malloc(sizeof(float*) * (size_t)(nr + nf + 1));
    float* zero = calloc((size_t)d, sizeof(float));
    if (!ptrs || !zero) { free(ptrs); free(zero); return -1; }
    for (int64_t r = 0; r < nr; ++r) ptrs[r] = ring + ring_rows[r] * d;
    for (int64_t r = 0; r < nf; ++r) ptrs[nr + r] = fresh + r * d;
    ptrs[nr + nf] = zero;
    attention_core(q, 0, ptrs, pool_rows, pool_bias, np, extra, extra_rows, extra_bias, ne, sinks, g, h, d, scale,
                   scratch, out);
    free(ptrs);
    free(zero);
    return 0;
}
#endif
"""
