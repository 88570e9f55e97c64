"""A delayed Ethernet wire between two TAP devices: the link between two buildings of a
NetnsCluster (netns.py) where the kernel has no ``sch_netem`` to delay a veth.

    python tap_wire.py TAP_A TAP_B DELAY_MS      (inside the namespace that holds both TAPs)

Both TAPs exist already (``ip tuntap add ... mode tap``) and sit in their buildings' bridges.
Every frame read from one is written to the other ``DELAY_MS`` after it was read, in order: a
constant one-way delay, so a round trip across the wire costs twice that. A TAP set down
(``ip link set TAP down``: the cut) neither delivers frames to us nor accepts ours; frames written
to it are dropped, as on a cut fibre. Prints ``tap wire ready`` once both are attached; SIGTERM
or SIGKILL ends it (the harness owns the process).
"""

from __future__ import annotations

import collections
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_FRAME = 65536 + 64
MAX_READS_PER_WAKE = 256  # frames read from one side before the other side gets a turn


def attach(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def relay(fd_a: int, fd_b: int, delay_s: float) -> None:
    # per direction: (due time, frame) in arrival order; constant delay keeps it sorted
    out2queue: dict[int, collections.deque] = {fd_a: collections.deque(), fd_b: collections.deque()}
    other = {fd_a: fd_b, fd_b: fd_a}
    poller = select.poll()
    for fd in (fd_a, fd_b):
        poller.register(fd, select.POLLIN)
    while True:
        due = [q[0][0] for q in out2queue.values() if q]
        timeout_ms = max(0.0, (min(due) - time.monotonic()) * 1000) if due else 1000.0
        for fd, _ in poller.poll(timeout_ms):
            queue = out2queue[other[fd]]
            for _ in range(MAX_READS_PER_WAKE):
                try:
                    frame = os.read(fd, MAX_FRAME)
                except (BlockingIOError, OSError):  # drained, or the device went down
                    break
                queue.append((time.monotonic() + delay_s, frame))
        now = time.monotonic()
        for out_fd, queue in out2queue.items():
            while queue and queue[0][0] <= now:
                _, frame = queue.popleft()
                try:
                    os.write(out_fd, frame)
                except OSError:  # EIO: that side is down (the link is cut); the frame is lost
                    pass


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: tap_wire.py TAP_A TAP_B DELAY_MS", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fd_a, fd_b = attach(argv[0]), attach(argv[1])
    print("tap wire ready", flush=True)
    relay(fd_a, fd_b, float(argv[2]) / 1000.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
