"""DEEPINFER_TRITON_OFF: ops named there keep their torch routing on CUDA (a kernel bisected or
turned off on a device without a code change); a name without a kernel is a one-line error."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from deepinfer import envs  # noqa: E402
from deepinfer.kernels import gpu_routing, ops  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_named_ops_keep_the_previous_routing():
    table = gpu_routing.routing(ops._active, " compress_pool, linear ")
    assert "compress_pool" not in table and "linear" not in table
    assert set(table) == set(gpu_routing.KERNELS) - {"compress_pool", "linear"}
    assert set(gpu_routing.routing(ops._active)) == set(gpu_routing.KERNELS)


def test_a_name_without_a_kernel_is_a_one_line_error():
    with pytest.raises(ValueError, match="DEEPINFER_TRITON_OFF names 'linaer', which has no Triton kernel"):
        gpu_routing.routing(ops._active, "linaer")


def test_the_variable_reaches_the_snapshot():
    assert envs.load({"DEEPINFER_TRITON_OFF": "compress_pool"}).triton_off == "compress_pool"
    assert envs.load({}).triton_off == ""
