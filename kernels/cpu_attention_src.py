"""C source of the AVX2 + FMA gathered attention (kernels/cpu_native.py compiles and picks it).

Same contract as ``gathered_attention`` in cpu_native_src.py (one token at a time, key rows read
in place by id, -inf keys skipped, the sink slot's logit from ``sinks``), organised for SIMD:

  scores   lanes are heads: q is transposed to [d, heads] once per token and each score is one
           FMA chain over the d channels (8 keys at a time, independent chains)
  softmax  per head over [valid window keys, sink, valid extra keys] in that order; exp is a
           fixed polynomial evaluated on whole 8-head vectors (no libm, no tails)
  output   per head, 64 channels in registers, one FMA chain over the valid keys in order

Every number of a token comes from that token's inputs through the same instruction sequence,
so tokens stand alone (batch-invariant). Results match the scalar kernel to a few ulp (FMA, a
different summation order and the polynomial exp).
"""

ATTENTION_SOURCE = r"""
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

/* sc[j * hp + hb + lane] = q_lane . key_j for up to 8 keys: independent FMA chains over d */
__attribute__((target("avx2,fma")))
static void score_keys(const float* qt, int64_t hp, int64_t hb, int64_t d, const float* const* keys, int64_t cnt,
                       float* sc) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    if (cnt == 8) {
        for (int64_t k = 0; k < d; ++k) {
            __m256 qv = _mm256_loadu_ps(qt + k * hp + hb);
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(keys[j] + k), acc[j]);
        }
    } else {
        for (int64_t k = 0; k < d; ++k) {
            __m256 qv = _mm256_loadu_ps(qt + k * hp + hb);
            for (int j = 0; j < cnt; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(keys[j] + k), acc[j]);
        }
    }
    for (int j = 0; j < cnt; ++j) _mm256_storeu_ps(sc + j * hp + hb, acc[j]);
}

/* o[0..8*nj) = sum_n p[n * hp] * keys[n][c0 ..], one FMA chain per channel over n in order */
__attribute__((target("avx2,fma")))
static void weigh_keys(const float* p, int64_t hp, const float* const* keys, int64_t nv, int64_t c0, int64_t nj,
                       float* o) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
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

/* scratch: (np + ne) * (hp + 3) + d * hp floats, hp = h rounded up to 8 */
__attribute__((target("avx2,fma")))
void gathered_attention_avx2(const float* q, const float* pool, const int64_t* pool_rows, const float* pool_bias,
                             int64_t np, const float* extra, const int64_t* extra_rows, const float* extra_bias,
                             int64_t ne, const float* sinks, int64_t g, int64_t h, int64_t d, float scale,
                             float* scratch, float* out) {
    int64_t n_all = np + ne, hp = (h + 7) / 8 * 8;
    const float** keys = (const float**)scratch;  /* [n_all] key row pointers (2 floats each) */
    float* sc = scratch + 2 * n_all;               /* [n_all][hp] scores, then probabilities */
    float* qt = sc + n_all * hp;                   /* [d][hp] the token's q, heads as lanes */
    float* bias = qt + d * hp;                     /* [n_all] */
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
            keys[nv] = n < np ? pool + pool_rows[i * np + n] * d : extra + extra_rows[i * ne + (n - np)] * d;
            bias[nv++] = b;
        }
        const float* qi = q + i * h * d;
        for (int64_t k = 0; k < d; ++k)
            for (int64_t hh = 0; hh < hp; ++hh) qt[k * hp + hh] = hh < h ? qi[hh * d + k] : 0.0f;
        __m256 vscale = _mm256_set1_ps(scale);
        for (int64_t hb = 0; hb < hp; hb += 8) {
            for (int64_t n0 = 0; n0 < nv; n0 += 8)
                score_keys(qt, hp, hb, d, keys + n0, nv - n0 < 8 ? nv - n0 : 8, sc + n0 * hp);
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
        float* oi = out + i * h * d;
        for (int64_t hh = 0; hh < h; ++hh)
            for (int64_t c0 = 0; c0 < d; c0 += 64) {
                int64_t nj = (d - c0 < 64 ? d - c0 : 64) / 8;
                weigh_keys(sc + hh, hp, keys, nv, c0, nj, oi + hh * d + c0);
            }
    }
}
#endif
"""
