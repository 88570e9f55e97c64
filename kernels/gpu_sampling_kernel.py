"""The Triton kernel behind kernels/gpu_sampling.py (imported only on a CUDA device; see there)."""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def gumbel_argmax_kernel(logits_ptr, row_stride, temp_ptr, keys_ptr, token_hash_ptr, out_ptr, vocab,
                         MUL_A: tl.constexpr, MUL_B: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.uint32)  # int64 key in [0, 2^32): its low 32 bits
    best_val = -float("inf")
    best_idx = 0
    nan_idx = vocab  # first NaN seen (vocab: none)
    base = logits_ptr + row.to(tl.int64) * row_stride
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        live = offs < vocab
        x = tl.load(base + offs, mask=live, other=0.0)
        h = key ^ tl.load(token_hash_ptr + offs, mask=live, other=0).to(tl.uint32, bitcast=True)
        h = h ^ (h >> 16)
        h = h * MUL_A
        h = h ^ (h >> 15)
        h = h * MUL_B
        h = h ^ (h >> 16)
        u = tl.minimum(((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0), 0.99999994039535522)  # counter_rng.U_MAX
        g = -libdevice.log(-libdevice.log(u))
        y = tl.math.div_rn(x, t) + g
        nan_idx = tl.minimum(nan_idx, tl.min(tl.where(live & (y != y), offs, vocab), 0))
        y = tl.where(live & (y == y), y, -float("inf"))
        m, i = tl.max(y, 0, return_indices=True, return_indices_tie_break_left=True)
        better = m > best_val  # strict: an equal maximum in a later block is not the first
        best_idx = tl.where(better, start + i, best_idx)
        best_val = tl.where(better, m, best_val)
    tl.store(out_ptr + row, tl.where(nan_idx < vocab, nan_idx, best_idx).to(tl.int64))

