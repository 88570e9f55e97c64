"""Shared pieces of the property tests of the native CPU kernels (test_native_*_hypothesis.py).

Hypothesis draws shapes and a seed; tensors come from a seeded torch generator (continuous
values, so top-k ties and exact zeros do not occur by accident). ``kernel_path`` runs a block on
one of the two native code paths: "avx2" (the SIMD kernels, when this CPU has them) or
"portable" (what a machine without AVX2 runs: the C fallbacks inside each entry point plus the
Python wrappers' choice of the scalar kernels).
"""

from __future__ import annotations

import contextlib

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from deepinfer.kernels import cpu_gemm, cpu_native

# small shapes and few examples: the whole kernel suite stays within seconds
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])

seeds = st.integers(0, 2**31 - 1)
paths = st.sampled_from(("avx2", "portable"))


def has_avx2() -> bool:
    lib = cpu_native.library()
    return lib is not None and bool(lib.gemm_has_avx2())


def randn(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def kernel_path(path: str, wrappers: bool = True):
    """Run the block on ``path`` ("avx2" or "portable"); "avx2" needs a CPU that has it.
    ``wrappers=False`` keeps the Python wrappers' choice of kernels (the fused blocks, which
    exist only with AVX2) and switches only the C code inside them to its portable loops."""
    lib = cpu_native.library()
    if path == "avx2" or lib is None:
        yield
        return
    saved = cpu_gemm._fast
    lib.gemm_use_avx2(0)
    if wrappers:
        cpu_gemm._fast = False
    try:
        yield
    finally:
        cpu_gemm._fast = saved
        lib.gemm_use_avx2(1)


def close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got, want.to(got.dtype), atol=atol, rtol=rtol)


def gemm_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` vs ``x @ w.T`` in float64, tolerance scaled by the magnitudes summed per element."""
    want = x.double() @ w.double().t()
    bound = x.double().abs() @ w.double().abs().t()
    err = (got.double() - want).abs()
    assert got.shape == want.shape
    assert bool((err <= 1e-6 * bound + 1e-6).all()), f"max error {err.max().item():.3g}"


def rope_tables(seed: int, rows: int, rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    from deepinfer.kernels import torch_ref

    positions = torch.randint(0, 5000, (rows,), generator=torch.Generator().manual_seed(seed))
    return torch_ref.rope_tables(positions, 1.0 / (1000.0 ** (torch.arange(0, rd, 2).float() / max(rd, 1))))
