"""The Triton kernels compile for Hopper (sm_90) at the V4-Flash shapes without a GPU, with no
register spills (ptxas' stack frame) and, for the expert GEMMs, with the tensor-core (wgmma) and
asynchronous-copy (cp.async) instructions the memory-bound decode needs (FP8 x FP8 ones for the FP8 GEMMs). Runs wherever Triton
is installed (its wheel carries ptxas and cuobjdump); skipped otherwise.

Operands are declared 16-byte aligned (``tt.divisibility``) as the JIT specialises torch tensors
and sizes that are multiples of 16; without it Triton emits scalar loads and no pipelining.
"""

from __future__ import annotations

import pytest

from tests.conftest import load_test_helper

sm90 = load_test_helper("kernels/sm90_compile")
sm90.skip_unless_compilable()

from deepinfer.kernels import (  # noqa: E402
    gpu_attention, gpu_compressor, gpu_fp8, gpu_mhc, gpu_moe, gpu_moe_fp8, gpu_norm,
)

pytestmark = [pytest.mark.timeout(300)]
BF, F32, I64, I32, FP8 = sm90.BF, sm90.F32, sm90.I64, sm90.I32, sm90.FP8
FP8_GEMM = dict(x_ptr=BF, xs_ptr=BF, w_ptr=FP8, ws_ptr=F32, y_ptr=BF)  # decode: bf16 rows quantised in the load
FP8_GEMM_Q = dict(x_ptr=FP8, xs_ptr=F32, w_ptr=FP8, ws_ptr=F32, y_ptr=BF)  # prefill: rows quantised before
MOE_UP_FP8 = dict(x_ptr=BF, xs_ptr=BF, w_ptr=FP8, ws_ptr=F32, tok_ptr=I32, bexp_ptr=I32, act_ptr=BF)
MOE_DOWN_FP8 = dict(act_ptr=BF, acts_ptr=BF, w_ptr=FP8, ws_ptr=F32, tok_ptr=I32, bexp_ptr=I32, y_ptr=BF)
MOE_UP_FP8_Q = {**MOE_UP_FP8, "x_ptr": FP8, "xs_ptr": F32}  # prefill: rows quantised before
MOE_DOWN_FP8_Q = {**MOE_DOWN_FP8, "act_ptr": FP8, "acts_ptr": F32}
MOE_UP = dict(x_ptr=BF, w_ptr=BF, tok_ptr=I32, bexp_ptr=I32, act_ptr=BF)
MOE_DOWN = dict(act_ptr=BF, w_ptr=BF, tok_ptr=I32, bexp_ptr=I32, y_ptr=BF)
ATTN = dict(q_ptr=BF, pool_ptr=BF, prow_ptr=I64, pbias_ptr=F32, extra_ptr=BF, erow_ptr=I64, ebias_ptr=F32,
            sinks_ptr=F32, out_ptr=BF, pm_ptr=F32, pl_ptr=F32, pacc_ptr=F32)
COMPRESS = dict(kv_ptr=BF, gate_ptr=BF, rkv_ptr=BF, rgate_ptr=BF, rrows_ptr=I64, idx_ptr=I64, valid_ptr="*u8",
                bias_ptr=F32, w_ptr=F32, out_ptr=BF)
# the compressor's row strides (widths of 256 .. 1024 elements) specialise as multiples of 16: vector loads
sm90.ALIGNED_INTS.update({"s_kv", "s_gate", "s_rkv", "s_rgate", "s_bias"})

# (name, kernel, pointer types, constexprs, num_warps, num_stages)
CASES = [
    ("rms_norm_rope q", gpu_norm._rms_norm_rope_kernel, dict(x_ptr=BF, w_ptr=F32, cos_ptr=F32, sin_ptr=F32, out_ptr=BF),
     dict(HAS_W=False, NORM=True, ROPE_DIM=64, HALF_P=32, BLOCK=512), 1, 3),
    ("hc mixes decode", gpu_mhc._mixes_kernel, dict(x_ptr=BF, fn_ptr=F32, part_ptr=F32, ss_ptr=F32),
     dict(CHUNK=256, BK=256, BT=1, MP=32, USE_DOT=False), 4, 3),
    ("hc finish", gpu_mhc._finish_kernel, dict(part_ptr=F32, ss_ptr=F32, x_ptr=BF, scale_ptr=F32, base_ptr=F32,
                                              comb_base_ptr=F32, post_ptr=F32, comb_ptr=F32, out_ptr=BF),
     dict(N=4, NP=4, MP=32, SP=64, HEAD=False, BD=512), 4, 3),
    ("hc sinkhorn", gpu_mhc._sinkhorn_kernel, dict(c_ptr=F32, out_ptr=F32), dict(N=4, NP=4, ITERS=20), 1, 3),
    ("attention split", gpu_attention._attention_kernel, ATTN,
     dict(BH=16, BN=32, BD=512, SPLIT=True, IEEE=False, UPCAST=False), 8, 3),
    ("moe route", gpu_moe._route_kernel, dict(logits_ptr=BF, bias_ptr=F32, hash_ptr=I64, ids_ptr=I64, w_ptr=F32),
     dict(K=6, KP=8, EP=64, MODE=0, HASH=False), 1, 3),
    ("moe align", gpu_moe._align_kernel, dict(ids_ptr=I64, tok_ptr=I32, rop_ptr=I64, bexp_ptr=I32),
     dict(BM=16, EP=64, BP=64, BB=64), 4, 3),
    ("moe align count", gpu_moe._align_count_kernel, dict(ids_ptr=I64, counts_ptr=I32), dict(EP=64, BP=64), 4, 3),
    ("moe align fill", gpu_moe._align_fill_kernel, dict(ids_ptr=I64, counts_ptr=I32, first_ptr=I32, base_ptr=I32,
                                                        tok_ptr=I32, rop_ptr=I64, bexp_ptr=I32),
     dict(BM=128, EP=64, BP=64, BB=64), 4, 3),
]
# the compressors: CSA (ratio 4, overlap, span 8) and HCA (ratio 128, span 128) at head_dim 512, and
# the CSA indexer's (head_dim 128)
for label, head_dim, span, overlap in (("csa", 512, 8, True), ("hca", 512, 128, False), ("csa indexer", 128, 8, True)):
    bs, dp, warps = gpu_compressor.tiles(head_dim, span)
    CASES.append((f"compress pool {label}", gpu_compressor._compress_kernel, COMPRESS,
                  dict(OVERLAP=overlap, HAS_BIAS=True, BS=bs, DP=dp), warps, 3))
for rows in (1, 64, 4096):  # the FP8 GEMM's decode (swapped, 16 or 64 rows x 64, K split) and prefill (128 x 128) tiles
    t = gpu_fp8._tiles(rows, 4096, 4096, False)
    CASES.append((f"fp8 gemm {t.bm}x{t.bn}", gpu_fp8._gemm_kernel, FP8_GEMM if t.swap else FP8_GEMM_Q,
                  dict(BM=t.bm, BN=t.bn, BK=128, SWAP=t.swap, EXACT=False, A_FP8=not t.swap, PARTIAL=t.splits > 1),
                  t.warps, t.stages))
for pairs in (6, 50_000):
    bm, bn, bk, stages, warps, swap = gpu_moe._tiles(pairs, False)
    flags = dict(BM=bm, BN=bn, BK=bk, SWAP=swap, IEEE=False, UPCAST=False)
    CASES.append((f"moe up {bm}x{bn}", gpu_moe._up_kernel, MOE_UP, flags, warps, stages))
    CASES.append((f"moe down {bm}x{bn}", gpu_moe._down_kernel, MOE_DOWN, flags, warps, stages))
    for up, kernel, pointers in ((True, gpu_moe_fp8._up_fp8_kernel, MOE_UP_FP8 if swap else MOE_UP_FP8_Q),
                                 (False, gpu_moe_fp8._down_fp8_kernel, MOE_DOWN_FP8 if swap else MOE_DOWN_FP8_Q)):
        bn8, stages8, warps8 = gpu_moe_fp8.tiles(swap, up)
        CASES.append((f"moe {'up' if up else 'down'} fp8 {bm}x{bn8}", kernel, pointers,
                      dict(BM=bm, BN=bn8, BK=128, SWAP=swap, EXACT=False, A_FP8=not swap), warps8, stages8))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_compiles_for_sm90_without_spills(case, tmp_path):
    name, kernel, pointers, constexprs, warps, stages = case
    compiled = sm90.compile_sm90(kernel, pointers, constexprs, warps, stages)
    usage = sm90.resources(compiled.asm["cubin"], tmp_path)
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0, f"{name}: register spills {usage}"
    ptx = compiled.asm["ptx"]
    if name.startswith(("moe up", "moe down")):
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx, f"{name}: no wgmma / cp.async pipeline"
    if name.startswith("compress pool"):  # rows gathered from two tensors still load 16 bytes at a time
        assert "ld.global.v4.b32" in ptx and "ld.global.b16" not in ptx, f"{name}: scalar row loads"
    if "fp8" in name:  # FP8 x FP8 on the tensor cores, operands streamed by cp.async
        wgmma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
        assert wgmma and all("e4m3.e4m3" in line for line in wgmma) and "cp.async" in ptx, f"{name}: no FP8 wgmma"
