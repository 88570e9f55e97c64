"""ops.use_gpu / kernels/gpu_routing.py: CUDA tensors go to the Triton kernels, every other
tensor keeps the routing it had (CPU numbers bitwise unchanged), registering twice changes
nothing, reset() restores the default routing."""

from __future__ import annotations

import torch

from deepinfer.kernels import ops
from tests.conftest import load_test_helper

cases = load_test_helper("kernels/gpu_cases")
cases.skip_unless_runnable()
from deepinfer.kernels import gpu_norm, gpu_routing  # noqa: E402

pytestmark = cases.marks()


def test_cpu_tensors_keep_their_routing_and_cuda_ones_take_the_kernels():
    x = torch.randn(6, 3, 40)
    w = torch.rand(40) + 0.5
    default = ops.rms_norm(x, w, 1e-6)
    fallbacks = dict(ops._active)
    try:
        for _ in range(2):  # a second registration wraps the same fallbacks
            for name, fn in gpu_routing.routing(ops._active).items():
                ops.register(name, fn)
        assert all(ops._active[n].gpu_fallback is fallbacks[n] for n in gpu_routing.KERNELS)
        assert ops.backend_of("rms_norm") == gpu_routing.__name__
        assert torch.equal(ops.rms_norm(x, w, 1e-6), default)
        if cases.HAS_CUDA:
            xc, wc = x.cuda(), w.cuda()
            assert torch.equal(ops.rms_norm(xc, wc, 1e-6), gpu_norm.rms_norm(xc, wc, 1e-6))
    finally:
        ops.reset()
    assert ops._active["rms_norm"] is fallbacks["rms_norm"]


def test_use_gpu_needs_cuda():
    try:
        assert ops.use_gpu() == cases.HAS_CUDA
        assert (ops.backend_of("hc_pre") == gpu_routing.__name__) == cases.HAS_CUDA
    finally:
        ops.reset()
