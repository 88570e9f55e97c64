"""Socket plumbing shared by every channel: context, options, bind/connect, drop accounting.

Every socket is made with ``linger=0`` (close never blocks on unsent data), optional CURVE keys
and an optional hard ``ZMQ_MAXMSGSIZE`` (a peer sending a larger frame is disconnected by libzmq
before the frame is buffered). ``bind`` accepts ``tcp://HOST:0`` and returns the resolved address.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import ErrorCode
from deepinfer.transport.security import CurveKeys, apply_curve

# A frame above HARD_LIMIT_FACTOR x the soft limit is cut off by libzmq (peer disconnected);
# between the two it is received, dropped and answered with OVERSIZED where possible.
HARD_LIMIT_FACTOR = 4

_NUM_DROPS_LOGGED = 10  # then one line per 1000 drops: a flood of bad frames must not flood logs


def default_context() -> zmq.asyncio.Context:
    """The process-wide asyncio context (one io thread)."""
    return zmq.asyncio.Context.instance()


# A connection whose peer went silent (cut link, hung host) is dropped after the timeout and made
# again, with connects that get no answer retried: a kept one resumes only at TCP's next
# retransmission, up to minutes after a long cut ends. For connecting sockets whose peer always
# reads (its libzmq answers the ZMTP PINGs): a PULL that stops reading would look silent.
SILENT_PEER_PING_MS = 1000
SILENT_PEER_TIMEOUT_MS = 3000
CONNECT_TIMEOUT_MS = 2000


def drop_silent_peers(sock: zmq.Socket) -> None:
    """Set before ``connect``: ZMTP heartbeats and a connect timeout on ``sock``'s connections."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, SILENT_PEER_PING_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, SILENT_PEER_TIMEOUT_MS)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)


def new_socket(
    ctx: zmq.asyncio.Context | None,
    kind: int,
    *,
    curve: CurveKeys | None = None,
    hard_max_bytes: int | None = None,
    sndhwm: int | None = None,
    rcvhwm: int | None = None,
) -> zmq.asyncio.Socket:
    sock = (ctx or default_context()).socket(kind)
    sock.linger = 0
    apply_curve(sock, curve)
    if hard_max_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, hard_max_bytes)
    if sndhwm is not None:
        sock.sndhwm = sndhwm
    if rcvhwm is not None:
        sock.rcvhwm = rcvhwm
    return sock


async def bind(sock: zmq.Socket, address: str, *, retry_s: float = 2.0) -> str:
    """Bind and return the resolved endpoint (``tcp://127.0.0.1:0`` -> the chosen port).

    An address still held by a socket that was just closed (libzmq closes asynchronously, so a
    node restarted in the same process can race its previous life) is retried for ``retry_s``.
    """
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + retry_s
    while True:
        try:
            sock.bind(address)
            return sock.last_endpoint.decode()
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or loop.time() >= give_up_at:
                raise OSError(f"cannot bind {address}: {exc}") from None
        await asyncio.sleep(0.02)


@dataclass(slots=True)
class ChannelStats:
    """Counters of one channel; exported as metrics by the runtime."""

    num_received: int = 0
    num_sent: int = 0
    num_dropped: int = 0
    num_late_replies: int = 0
    dropped_by_code: dict[ErrorCode, int] = field(default_factory=dict)
    last_error: TransportError | None = None

    def record_drop(self, error: TransportError, logger: logging.Logger, channel: str) -> None:
        self.num_dropped += 1
        self.dropped_by_code[error.code] = self.dropped_by_code.get(error.code, 0) + 1
        self.last_error = error.with_traceback(None)  # its traceback would keep the dropped frames alive
        if self.num_dropped <= _NUM_DROPS_LOGGED or self.num_dropped % 1000 == 0:
            logger.warning("%s: dropped frame (%s, %d dropped so far): %s",
                           channel, error.code.name, self.num_dropped, error)
