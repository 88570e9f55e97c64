"""Shared pieces of the Triton kernel tests (tests/kernels/test_gpu_*.py).

They run on a CUDA device, or on the CPU through Triton's interpreter when TRITON_INTERPRET=1
is set and Triton is installed (slow: few examples); otherwise the modules skip before importing
Triton, so CPU CI never loads it. Every check compares with torch_ref evaluated in float64 on the
same inputs (relative Frobenius error), and every kernel output is allocated poisoned (NaN for
floats) so an element a kernel never writes fails the check.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch
from hypothesis import Phase, settings

HAS_CUDA = torch.cuda.is_available()
INTERPRETED = not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1"
RUNNABLE = (HAS_CUDA or INTERPRETED) and importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if HAS_CUDA else "cpu"
SKIP_REASON = "needs a CUDA device with Triton (or TRITON_INTERPRET=1 with Triton on the CPU)"
MAX_EXAMPLES = 6 if HAS_CUDA else 3  # each new shape class compiles kernels: keep the set small
# the interpreter is ~1000x slower: no shrinking there (a failure prints its example as is)
PHASES = None if HAS_CUDA else (Phase.explicit, Phase.reuse, Phase.generate)

F32_TOL = 2e-5  # float32 kernels (IEEE products) against float64
# a few bf16 roundings (2^-8 each) against float64; the interpreter's casts to bf16 truncate
# (a bias towards zero that adds up over a kernel's roundings)
BF16_TOL = 1.6e-2 if HAS_CUDA else 4e-2


def skip_unless_runnable() -> None:
    if not RUNNABLE:
        pytest.skip(SKIP_REASON, allow_module_level=True)


def marks() -> list:
    return [pytest.mark.gpu, pytest.mark.timeout(600 if INTERPRETED else 300)]


def examples(**kw):
    """Hypothesis settings of these tests (no deadline: first calls compile kernels)."""
    return settings(max_examples=MAX_EXAMPLES, deadline=None, **({} if PHASES is None else {"phases": PHASES}), **kw)


def tol(dtype: torch.dtype) -> float:
    return F32_TOL if dtype == torch.float32 else BF16_TOL


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` in float64; inf if ``got`` holds a NaN (a poisoned element left)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (got.shape, want.shape)
    if torch.isnan(got).any():
        return float("inf")
    scale = want.norm().item()
    return (got - want).norm().item() / (scale if scale > 0 else 1.0)


def randn(*shape, dtype=torch.float32, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def poisoned_allocations():
    """``torch.empty``/``empty_like`` hand out NaN-filled float tensors (and 2^30 in int tensors)
    while the block runs, so outputs and scratch buffers a kernel never writes show up."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(1 << 30)
        return t

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like
