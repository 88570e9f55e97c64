"""Fixtures of the V4.1 tests: the tiny official-layout checkpoint (FP8/FP4 storage) written once."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_test_helper

harness = load_test_helper("engine/v41/v41_harness")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("v41") / "tiny"
    harness.write_tiny_v41(out, seed=0, **harness.TEST_SIZES)
    return out


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny GEMMs gain nothing from a second thread on the shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
