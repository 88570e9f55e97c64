"""Fixtures shared by every suite: free loopback ports, temp dirs, child-process cleanup."""

from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
