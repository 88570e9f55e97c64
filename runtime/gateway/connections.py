"""The gateway's HTTP connections: deadlines, a cap on how many are open, JSON for broken HTTP.

aiohttp's low-level server answers HTTP its parser refuses with a text/plain 400 and an ERROR
traceback in the log, waits an hour for a request's headers, and accepts connections until the
process runs out of file descriptors. ``GatewayRunner`` (an ``AppRunner``) serves the app through
``GatewayProtocol`` instead:

- refused HTTP (a line or header over 8190 bytes, over 128 headers, bad chunked framing,
  Content-Length with Transfer-Encoding, a bad request line) gets the OpenAI-format JSON error of
  errors.py and one log line; a framing error in the body of a request being served fails that
  request's body read at once (aiohttp would leave the handler waiting for it forever);
- a connection must send complete headers within ``header_timeout_s`` of being accepted, or of
  the first byte of a later request on it: else it is closed (with a 408 when bytes came); an idle
  keep-alive connection is closed after ``keepalive_timeout_s`` (aiohttp's own timer); the body's
  deadline is the app's (app.py reads it under ``body_timeout_s``);
- with ``max_connections`` open, a new connection gets a 503 and is closed at once, so a flood of
  slow clients cannot take the descriptors the open connections and the engine need.

The protocol reads a few of ``RequestHandler``'s attributes (``_waiter``, ``_messages``,
``_current_request``) to know where a connection stands; tests/runtime/test_gateway_hostile.py
pins the behaviour, so an aiohttp upgrade that moves them fails there, not in production.
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http import RawRequestMessage
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from deepinfer.runtime.gateway.config import GatewayConfig
from deepinfer.runtime.gateway.errors import GatewayError, error_payload, error_response, malformed_http_error

log = logging.getLogger(__name__)

# aiohttp's parser limits, fixed here so they do not change with the aiohttp version
HTTP_LIMITS = {"max_line_size": 8190, "max_field_size": 8190, "max_headers": 128}
# descriptors kept for the engine, its sockets and files when the open-file limit bounds the cap
FD_RESERVE = 256
# aiohttp's default: how long a request's unread body may drain after its response
LINGER_MAX_S = 10.0
REFUSAL_LOG_INTERVAL_S = 10.0


def connection_cap(max_connections: int, fd_soft_limit: int) -> int:
    """Connections to hold at once: ``max_connections``, lowered so the open-file limit keeps
    ``FD_RESERVE`` descriptors (or half of a small limit) for everything else. -1: no limit."""
    if fd_soft_limit == resource.RLIM_INFINITY or fd_soft_limit < 0:
        return max_connections
    usable = max(fd_soft_limit // 2, fd_soft_limit - FD_RESERVE)
    return max(1, min(max_connections, usable))


class EveryInterval:
    """At most one report per ``interval_s``; a report carries the events since the last one."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._next_at = -math.inf
        self._count = 0

    def tick(self, now: float) -> int:
        """Count one event; the number to report now (0: stay quiet)."""
        self._count += 1
        if now < self._next_at:
            return 0
        count, self._count = self._count, 0
        self._next_at = now + self.interval_s
        return count


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _raw_response(err: GatewayError) -> bytes:
    """A complete HTTP/1.1 response for ``err`` that closes the connection, written straight to a
    transport (no request object exists yet)."""
    body = error_payload(err)
    head = [f"HTTP/1.1 {err.status} {_phrase(err.status)}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in err.headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class GatewayServer(Server):
    """aiohttp's low-level server with ``GatewayProtocol`` connections and their shared count."""

    def __init__(self, handler, *, config: GatewayConfig, max_connections: int,
                 count_response: Callable[[int], None], loop: asyncio.AbstractEventLoop, **kwargs: Any):
        protocol_kwargs = {k: v for k, v in kwargs.items() if k not in ("request_factory", "handler_cancellation")}
        super().__init__(handler, loop=loop, **kwargs)
        self.config = config
        self.max_connections = max_connections
        self.count_response = count_response
        self.num_open = 0
        self.refusals = EveryInterval(REFUSAL_LOG_INTERVAL_S)
        self._event_loop = loop
        self._protocol_kwargs = protocol_kwargs

    def __call__(self) -> GatewayProtocol:
        return GatewayProtocol(self, loop=self._event_loop, **self._protocol_kwargs)


class GatewayProtocol(RequestHandler):
    """One HTTP connection: aiohttp's handler plus the header deadline, the cap and JSON errors."""

    __slots__ = ("_gateway", "_counted", "_header_timer", "_header_bytes")

    def __init__(self, manager: GatewayServer, *, loop: asyncio.AbstractEventLoop, **kwargs: Any):
        super().__init__(manager, loop=loop, **kwargs)
        self._gateway = manager
        self._counted = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = False  # bytes of a request head arrived since the timer was armed

    # -- connection life ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gateway = self._gateway
        if gateway.num_open >= gateway.max_connections:
            self._refuse(transport)
            return
        gateway.num_open += 1
        self._counted = True
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._counted = False
            self._gateway.num_open -= 1
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        gateway = self._gateway
        self._force_close = True  # never registered with the server: nothing to undo on loss
        self._manager = None
        err = GatewayError(f"the server holds its maximum of {gateway.max_connections} connections; retry shortly",
                           status=503, code="too_many_connections",
                           headers={"Retry-After": str(gateway.config.retry_after_s)})
        transport.write(_raw_response(err))  # type: ignore[attr-defined]
        transport.close()
        refused = gateway.refusals.tick(time.monotonic())
        if refused:
            log.warning("refused %d connection(s): %d are open, the maximum (--max-connections)", refused,
                        gateway.max_connections)

    # -- the header deadline ------------------------------------------------------------------

    def _awaiting_request(self) -> bool:
        """Idle between requests or inside a request's head: nothing parsed, nothing being served."""
        waiter = self._waiter
        return waiter is not None and not waiter.done() and not self._messages

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self.keep_alive(True)  # drops aiohttp's idle timer: this deadline rules until the head is in
        self._header_bytes = False
        self._header_timer = self._loop.call_later(self._gateway.config.header_timeout_s, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None  # re-armed by the next request's first byte
        if self.transport is None or not self._awaiting_request():
            return
        timeout = self._gateway.config.header_timeout_s
        if self._header_bytes:
            err = GatewayError(f"the request headers did not arrive within {timeout:g} s", status=408,
                               code="header_timeout")
            self.transport.write(_raw_response(err))
            self._gateway.count_response(408)
        log.debug("closed a connection from %s: no complete request headers within %g s", self.peername, timeout)
        self.force_close()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._awaiting_request():
            self._arm_header_timer()  # the first bytes of a request after an idle spell
        self._header_bytes = self._header_bytes or bool(data)
        super().data_received(data)
        if self._messages:  # a request head is complete; its body runs under the app's deadline
            self._disarm_header_timer()
            self._fail_body_on_parse_error()

    def _fail_body_on_parse_error(self) -> None:
        # aiohttp queues a parse error as the next message but leaves the body of the request
        # being served unfinished: its handler would wait for that body until the client left
        request = self._current_request
        last = self._messages[-1][0]
        if request is None or isinstance(last, RawRequestMessage) or request.content.is_eof():
            return
        exc = getattr(last, "exc", None)
        request.content.set_exception(exc if isinstance(exc, HttpProcessingError)
                                      else BadHttpMessage("malformed request body"))
        request.content.feed_eof()  # nothing left to drain after the response

    # -- errors outside the app ---------------------------------------------------------------

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """The response for HTTP the parser refused (or a failure outside the app's middleware):
        OpenAI-format JSON, one log line for client errors, a traceback only for server faults."""
        if request.writer.output_size > 0:
            raise ConnectionError("the response is under way; cannot send the error instead")
        if isinstance(exc, HttpProcessingError):
            err = malformed_http_error(exc)
            log.info("refused malformed HTTP from %s: %s", request.remote, err.message)
        else:
            if exc is not None:
                log.error("error serving a request from %s", request.remote, exc_info=exc)
            err = GatewayError(f"{_phrase(status).lower()}; see the server log", status=status, code=f"http_{status}",
                               close_connection=True)
        self._gateway.count_response(err.status)
        response = error_response(err)
        response.force_close()
        return response


class GatewayRunner(web.AppRunner):
    """``web.AppRunner`` serving through ``GatewayServer`` with ``config``'s connection settings."""

    def __init__(self, app: web.Application, config: GatewayConfig, *,
                 count_response: Callable[[int], None] = lambda status: None, **kwargs: Any):
        kwargs.setdefault("keepalive_timeout", config.keepalive_timeout_s)
        kwargs.setdefault("lingering_time", min(LINGER_MAX_S, config.body_timeout_s))
        for name, value in HTTP_LIMITS.items():
            kwargs.setdefault(name, value)
        super().__init__(app, **kwargs)
        self.config = config
        self._count_response = count_response

    async def _make_server(self) -> Server:
        plain = await super()._make_server()  # runs the app's start-up hooks and freezes it
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        cap = connection_cap(self.config.max_connections, soft_limit)
        if cap < self.config.max_connections:
            log.info("serving at most %d connections, not %d: the open-file limit is %d (raise it with ulimit -n)",
                     cap, self.config.max_connections, soft_limit)
        # the same arguments aiohttp gave its own server (protocol settings, the app's handler_args)
        kwargs = dict(getattr(plain, "_kwargs", {}))
        return GatewayServer(plain.request_handler, config=self.config, max_connections=cap,
                             count_response=self._count_response, loop=asyncio.get_running_loop(),
                             request_factory=plain.request_factory, handler_cancellation=plain.handler_cancellation,
                             **kwargs)
