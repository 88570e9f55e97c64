"""C source of the whole V4 MoE block in one native call (kernels/cpu_moe.py wraps it).

At decode sizes the MoE's Python stages (router GEMM, routing, dispatch plan, routed experts,
shared expert, combine) cost more in per-call overhead than in arithmetic. ``moe_forward``
runs the same native pieces in the same order as engine/models/deepseek_v4/moe.py's native
path (moe_route, moe_dispatch without padding, moe_experts, the shared expert through the
fixed-order GEMM and SIMD SwiGLU, moe_combine), so its numbers are bitwise that path's.
"""

MOE_SOURCE = r"""
/* out [rows, h] = shared expert of every row + routed experts of the first t rows.
   router [e, h] packed; bias [e] or NULL (hash layers); tid2eid [vocab, k] or NULL (learned
   layers) with token_ids [t]; gate_up / down the experts' packed weights (strides in floats);
   shared_gu [2 * si, h] / shared_down [h, si] packed. Returns 0, or -1 when memory ran out. */
int64_t moe_forward(const float* x, int64_t rows, int64_t t, int64_t h, const float* router, int64_t e,
                    const float* bias, const int64_t* tid2eid, const int64_t* token_ids, int64_t k,
                    int64_t scoring, float scale, const float* gate_up, int64_t gate_up_stride, const float* down,
                    int64_t down_stride, int64_t inter, float limit, const float* shared_gu,
                    const float* shared_down, int64_t si, float* out) {
    int64_t pairs = t * k;
    size_t floats = (size_t)(t * e + pairs + rows * 3 * si + pairs * h + t * (h + 3 * inter));
    size_t longs = (size_t)(pairs + 2 * e + pairs + pairs + 3 * e + 3);
    float* fbuf = malloc(floats * sizeof(float) + 64);
    int64_t* ibuf = malloc(longs * sizeof(int64_t) + 64);
    if (!fbuf || !ibuf) { free(fbuf); free(ibuf); return -1; }
    float* logits = fbuf;
    float* weights = logits + t * e;
    float* shared_hidden = weights + pairs;
    float* shared_act = shared_hidden + rows * 2 * si;
    float* expert_rows = shared_act + rows * si;
    float* expert_scratch = expert_rows + pairs * h;
    int64_t* ids = ibuf;
    int64_t* counts = ids + pairs;
    int64_t* fill = counts + e;
    int64_t* token_of_row = fill + e;
    int64_t* row_of_pair = token_of_row + pairs;
    int64_t* seg = row_of_pair + pairs;
    int64_t* meta = seg + 3 * e;

    /* shared expert on every row (padding rows included, as the Python path does) */
    gemm(x, rows, h, h, shared_gu, 2 * si, shared_hidden, 2 * si);
    swiglu_fast(shared_hidden, rows, si, limit, shared_act);
    gemm(shared_act, rows, si, si, shared_down, h, out, h);
    if (t > 0) {
        gemm(x, t, h, h, router, e, logits, e);
        const int64_t* hashed = 0;
        if (tid2eid) {
            for (int64_t r = 0; r < t; ++r)
                for (int64_t j = 0; j < k; ++j) ids[r * k + j] = tid2eid[token_ids[r] * k + j];
            hashed = ids;  /* moe_route copies hashed ids into ids row by row: same row, same values */
        }
        moe_route(logits, t, e, bias, hashed, k, scoring, scale, ids, weights);
        moe_dispatch(ids, pairs, k, e, 0, -((int64_t)1 << 40), counts, fill, token_of_row, row_of_pair, seg, meta);
        moe_experts(x, h, token_of_row, seg, meta[1], gate_up, gate_up_stride, down, down_stride, inter, limit,
                    expert_scratch, expert_rows);
        moe_combine(out, expert_rows, row_of_pair, weights, t, k, h);
    }
    free(fbuf);
    free(ibuf);
    return 0;
}
"""
