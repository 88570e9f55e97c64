"""Fixtures shared by every suite: free loopback ports, temp dirs, child-process cleanup."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from deepinfer.transport.ports import free_tcp_port as free_port  # below the ephemeral range

TESTS_DIR = Path(__file__).parent


def load_test_helper(path: str) -> ModuleType:
    """Import ``tests/<path>.py`` once, under its file name as the module name.

    tests/ has no packages (pytest's importlib import mode), so a test cannot import a sibling
    helper by name; test modules call this at import time:
    ``harness = load_test_helper("runtime/gateway_harness")`` (import it with
    ``from tests.conftest import load_test_helper``: pytest registers this file as tests.conftest)."""
    file = TESTS_DIR / f"{path}.py"
    name = file.stem
    if name not in sys.modules:
        if not file.is_file():
            raise FileNotFoundError(f"no test helper {file}")
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it, so its own imports of it resolve
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_bench_package():
    """Register tests/bench as the package ``deepinfer_bench`` (tests/bench/package_loader.py)."""
    return load_test_helper("bench/package_loader").load_bench_package()


def load_bench_module(name: str):
    """Import ``tests/bench/bench_<name>.py`` in-process (what `deepinfer bench NAME` runs in a child)."""
    return load_test_helper("bench/package_loader").load_bench_module(name)


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def one_torch_thread():
    """Run a test with one torch thread: tiny GEMMs gain nothing from a second thread and stall
    badly on a busy 2-core machine. Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
