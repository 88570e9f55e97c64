"""Free loopback TCP ports for processes that must know an address before anything listens on it
(a local cluster's config file, tests that start peers which connect to each other).

``bind(port 0)`` hands out ports from the kernel's ephemeral range, and so does every outgoing
connection for its source port: ZeroMQ retrying a connect to a peer that is not listening yet
takes a fresh ephemeral source port per attempt, and can take the very port a second peer is
about to bind ("Address already in use"). Ports chosen below the ephemeral range are never used
as source ports, so such a port stays free until someone binds it on purpose.
"""

from __future__ import annotations

import random
import socket

_LOWEST = 10_000  # well above the registered services that matter on a test machine
_handed_out: set[int] = set()  # this process never hands one port out twice


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default; other systems start higher


def _is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now, outside the ephemeral range when there
    is room below it (else any free port from the kernel)."""
    high = _ephemeral_low()
    if high - _LOWEST >= 1_000:
        for _ in range(200):
            port = random.randrange(_LOWEST, high)
            if port not in _handed_out and _is_free(host, port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
