"""C source of the native CPU kernels (kernels/cpu_native.py compiles and loads it).

Rules every kernel keeps: float32 arithmetic in a fixed order with FMA contraction off, every
row / token computed by the same scalar or fixed-lane code wherever it sits in a call (so a
token's numbers depend on that token alone: batch-invariant), and no reassociation that a
vector width could change (lane loops use 8 explicit accumulators, identical on every ISA).
"""

C_SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* an AVX2 clone next to the baseline one, picked at load time; fixed-lane loops give the same
   numbers in both (no FMA contraction) */
#if defined(__x86_64__) && defined(__GNUC__)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

/* Sinkhorn-Knopp of one row's n x n matrix (columns first): hc_pre's, and the GEMM part's mHC */
static void sinkhorn_row(float* c, int64_t n, int64_t iters, float eps) {
    for (int64_t it = 0; it < iters; ++it) {
        if (it > 0) {
            for (int64_t i = 0; i < n; ++i) {
                float s = c[i * n];
                for (int64_t j = 1; j < n; ++j) s = s + c[i * n + j];
                s = s + eps;
                for (int64_t j = 0; j < n; ++j) c[i * n + j] = c[i * n + j] / s;
            }
        }
        for (int64_t j = 0; j < n; ++j) {
            float s = c[j];
            for (int64_t i = 1; i < n; ++i) s = s + c[i * n + j];
            s = s + eps;
            for (int64_t i = 0; i < n; ++i) c[i * n + j] = c[i * n + j] / s;
        }
    }
}

/* mixes [rows, (2+n)*n]: pre | post | comb logits (before scale and bias); streams [rows, n, d].
   Outputs: post [rows, n], comb [rows, n, n], collapsed [rows, d]. */
MULTIVERSION
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
        sinkhorn_row(c, n, iters, hc_eps);
        const float* x = streams + r * n * d;
        float* out = collapsed + r * d;
        for (int64_t k = 0; k < d; ++k) out[k] = pre[0] * x[k];
        for (int64_t j = 1; j < n; ++j)  /* stream by stream: vectorises, same order per element */
            for (int64_t k = 0; k < d; ++k) out[k] = out[k] + pre[j] * x[j * d + k];
    }
}

/* RMSNorm of rows x[o * so + i * si + 0..d) (o < outer, i < inner) into contiguous out;
   weight may be NULL. */
MULTIVERSION
void rms_norm(const float* x, int64_t outer, int64_t inner, int64_t so, int64_t si, int64_t d,
              const float* weight, float eps, float* out) {
    for (int64_t o = 0; o < outer; ++o) {
        for (int64_t i = 0; i < inner; ++i) {
            const float* row = x + o * so + i * si;
            float* dst = out + (o * inner + i) * d;
            float ss;
            if (d % 8 == 0) {  /* 8 fixed lanes (vectorisable), then a fixed tree */
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int64_t k = 0; k < d; k += 8)
                    for (int j = 0; j < 8; ++j) acc[j] = acc[j] + row[k + j] * row[k + j];
                ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
            } else {
                ss = 0.0f;
                for (int64_t k = 0; k < d; ++k) ss = ss + row[k] * row[k];
            }
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

/* Gathered shared-KV attention with a sink, one token at a time (see torch_ref.gathered_attention).
   q [g, h, d]; token i's keys: pool rows pool_rows[i, 0..np) (the last one the sink slot, whose
   logit is sinks[head]) then extra rows extra_rows[i, 0..ne); bias [g, np] and [g, ne] (0 / -inf,
   -inf keys are skipped); out [g, h, d]. d % 8 == 0. Dot products and sums run in 8 fixed lanes
   (vectorisable, same order on every ISA), keys in ascending order: per token, batch-invariant.
   scratch: h * (np + ne) floats. */

static inline float dot8(const float* a, const float* b, int64_t d) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t k = 0; k < d; k += 8)
        for (int j = 0; j < 8; ++j) acc[j] = acc[j] + a[k + j] * b[k + j];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

MULTIVERSION
void gathered_attention(const float* q, const float* pool, const int64_t* pool_rows, const float* pool_bias,
                        int64_t np, const float* extra, const int64_t* extra_rows, const float* extra_bias,
                        int64_t ne, const float* sinks, int64_t g, int64_t h, int64_t d, float scale,
                        float* scratch, float* out) {
    int64_t n_all = np + ne;
    for (int64_t i = 0; i < g; ++i) {
        const float* qi = q + i * h * d;
        float* oi = out + i * h * d;
        for (int64_t n = 0; n < n_all; ++n) {
            float b = n < np ? pool_bias[i * np + n] : extra_bias[i * ne + (n - np)];
            if (n == np - 1) {  /* the sink slot */
                for (int64_t hh = 0; hh < h; ++hh) scratch[hh * n_all + n] = sinks[hh];
                continue;
            }
            if (b == -INFINITY) {
                for (int64_t hh = 0; hh < h; ++hh) scratch[hh * n_all + n] = -INFINITY;
                continue;
            }
            const float* key = n < np ? pool + pool_rows[i * np + n] * d : extra + extra_rows[i * ne + (n - np)] * d;
            for (int64_t hh = 0; hh < h; ++hh) {
                float s = dot8(qi + hh * d, key, d) * scale;
                scratch[hh * n_all + n] = s + b;
            }
        }
        for (int64_t hh = 0; hh < h; ++hh) {
            float* s = scratch + hh * n_all;
            float mx = -INFINITY;
            for (int64_t n = 0; n < n_all; ++n) if (s[n] > mx) mx = s[n];
            float sum = 0.0f;
            for (int64_t n = 0; n < n_all; ++n) {
                float e = s[n] == -INFINITY ? 0.0f : expf(s[n] - mx);
                s[n] = e;
                sum = sum + e;
            }
            float* o = oi + hh * d;
            for (int64_t k = 0; k < d; ++k) o[k] = 0.0f;
            for (int64_t n = 0; n < n_all; ++n) {
                if (n == np - 1 || s[n] == 0.0f) continue;  /* the sink row is zero */
                float p = s[n] / sum;
                const float* key = n < np ? pool + pool_rows[i * np + n] * d : extra + extra_rows[i * ne + (n - np)] * d;
                for (int64_t k = 0; k < d; ++k) o[k] = o[k] + p * key[k];
            }
        }
    }
}

/* New mHC streams: result[r, k, :] = post[r, k] * out[r, :] + sum_j comb[r, j, k] * streams[r, j, :]
   (j ascending), per row in a fixed order. */
MULTIVERSION
void hc_post(const float* out, const float* streams, const float* post, const float* comb, int64_t rows,
             int64_t n, int64_t d, float* result) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* o = out + r * d;
        const float* x = streams + r * n * d;
        const float* c = comb + r * n * n;
        for (int64_t k = 0; k < n; ++k) {
            float* dst = result + (r * n + k) * d;
            float p = post[r * n + k];
            /* stream by stream so the loops over e vectorise; per element the same order */
            for (int64_t e = 0; e < d; ++e) dst[e] = c[k] * x[e];
            for (int64_t j = 1; j < n; ++j) {
                float w = c[j * n + k];
                const float* xj = x + j * d;
                for (int64_t e = 0; e < d; ++e) dst[e] = dst[e] + w * xj[e];
            }
            for (int64_t e = 0; e < d; ++e) dst[e] = p * o[e] + dst[e];
        }
    }
}

/* MoE dispatch plan (engine/models/deepseek_v4/moe.py): pairs p = t * k + j of expert ids[p]
   grouped by expert, the i-th pair of an expert at row first[e] + i; segments padded to
   pad(count) rows (pad_mode 1: gemm_rows) or, when cheaper, every expert padded to the busiest
   (dense). Writes token_of_row (padding rows 0), row_of_pair, seg [(expert, first, end)] and
   meta = (num_rows, num_segments, rows_per_expert or 0). counts/fill: scratch of e entries. */
static int64_t pad_rows(int64_t n, int64_t mode) { return mode && n < 12 ? (n + 3) / 4 * 4 : n; }

void moe_dispatch(const int64_t* ids, int64_t pairs, int64_t k, int64_t e, int64_t pad_mode, int64_t dense_cost,
                  int64_t* counts, int64_t* fill, int64_t* token_of_row, int64_t* row_of_pair, int64_t* seg,
                  int64_t* meta) {
    for (int64_t x = 0; x < e; ++x) { counts[x] = 0; fill[x] = 0; }
    for (int64_t p = 0; p < pairs; ++p) counts[ids[p]] += 1;
    int64_t most = 0, busy = 0, loop_rows = 0;
    for (int64_t x = 0; x < e; ++x) {
        if (!counts[x]) continue;
        busy += 1;
        loop_rows += pad_rows(counts[x], pad_mode);
        if (counts[x] > most) most = counts[x];
    }
    int64_t per = pad_rows(most, pad_mode);
    int dense = e * per <= loop_rows + dense_cost * busy;
    int64_t rows = 0, nseg = 0;
    for (int64_t x = 0; x < e; ++x) {
        if (!dense && !counts[x]) { fill[x] = -1; continue; }
        int64_t size = dense ? per : pad_rows(counts[x], pad_mode);
        seg[nseg * 3] = x; seg[nseg * 3 + 1] = rows; seg[nseg * 3 + 2] = rows + size;
        fill[x] = rows;  /* next free row of expert x */
        rows += size; nseg += 1;
    }
    for (int64_t r = 0; r < rows; ++r) token_of_row[r] = 0;
    for (int64_t p = 0; p < pairs; ++p) {
        int64_t row = fill[ids[p]]++;
        row_of_pair[p] = row;
        token_of_row[row] = p / k;
    }
    meta[0] = rows; meta[1] = nseg; meta[2] = dense ? per : 0;
}

/* out[r, j] = silu(min(g, limit)) * clamp(u, -limit, limit), gate_up rows = [g (m) | u (m)]. */
MULTIVERSION
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
