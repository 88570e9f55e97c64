"""Compile a Triton kernel for Hopper (sm_90) without a GPU and read its resource usage: the shared
piece of tests/kernels/test_gpu_compile.py and the per-kernel compile checks beside it.

Operands are declared 16-byte aligned (``tt.divisibility``) as the JIT specialises torch tensors
and sizes that are multiples of 16; without it Triton emits scalar loads and no pipelining. Import
only where Triton is installed and not interpreted (``skip_unless_compilable`` says so).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess

import pytest

BF, F32, I64, I32, FP8 = "*bf16", "*fp32", "*i64", "*i32", "*fp8e4nv"
ALIGNED_INTS = {"H", "I", "D", "K", "s_row", "s_outer", "s_inner", "o_outer", "o_inner", "sq_g", "sq_h", "s_out"}
FLOATS = {"eps", "scale", "limit", "factor", "comb_scale", "norm_eps", "hc_eps"}


def skip_unless_compilable() -> None:
    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs Triton, not its interpreter", allow_module_level=True)


def compile_sm90(kernel, pointers: dict, constexprs: dict, warps: int, stages: int):
    """``kernel`` compiled for sm_90: ``pointers`` maps pointer arguments to Triton types, other
    non-constexpr arguments are i32 (or fp32 when named in FLOATS)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = pointers.get(name, "fp32" if name in FLOATS else "i32")
        if name.endswith("_ptr") or name in ALIGNED_INTS:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def resources(cubin: bytes, tmp_path) -> dict[str, int]:
    """REG / STACK / LOCAL of the compiled kernel (cuobjdump from Triton's wheel)."""
    import triton

    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    report = subprocess.run([tool, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True)
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", report.stdout)}
