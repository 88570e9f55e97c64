"""The response's wire: what every response carries besides its JSON, and how a stream is framed.

``X-Request-Id`` on every response: the client's own id when it sent a usable one, else a new
one. The id is also the prefix of the request's engine request ids (``engine_request_id``), so a
line any part of the stack logs about the request can be found by the id the client holds:

    client  X-Request-Id: job-17            engine ids  job-17.chatcmpl-3f2a...-0, ...-1
    (none)  -> generated 9c41e0...          engine ids  9c41e0....chatcmpl-77b1...-0

A client id is used as sent when it is 1-128 characters of ``[A-Za-z0-9._:@/+=-]``; anything
else (control characters, a header meant to break logs) is replaced by a generated id.

Streams are server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` ...
``data: [DONE]\\n\\n``. A write to a client that went away raises ``ClientGone``; the serving
code treats it like a cancelled handler: it stops reading the engine and aborts the request.
``add`` + ``flush`` coalesce events that are ready at the same moment (n > 1 choices, or a
consumer that fell behind the engine) into one socket write; nothing waits to be batched.
"""

from __future__ import annotations

import re
import uuid

from aiohttp import web

# ---- X-Request-Id ---------------------------------------------------------------------------------
HEADER = "X-Request-Id"
REQUEST_ID_KEY = web.RequestKey("deepinfer_request_id", str)  # where the id lives on the aiohttp request
_USABLE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


def request_id(request: web.Request) -> str:
    """The request's id (assigned on first use, so it also exists outside the middleware)."""
    rid = request.get(REQUEST_ID_KEY)
    if rid is None:
        sent = request.headers.get(HEADER)
        rid = sent if sent is not None and _USABLE.fullmatch(sent) else uuid.uuid4().hex
        request[REQUEST_ID_KEY] = rid
    return rid


def engine_request_id(request: web.Request, response_id: str, index: int) -> str:
    """Engine request id of choice ``index``: unique (the response id) and findable (the request id)."""
    return f"{request_id(request)}.{response_id}-{index}"


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: runs for every response, streamed ones and errors included."""
    response.headers[HEADER] = request_id(request)


# ---- server-sent events ---------------------------------------------------------------------------
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed the connection while we were streaming to it."""


class SSEWriter:
    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
            },
        )
        self.is_started = False
        self._pending: list[bytes] = []

    async def start(self) -> None:
        try:
            await self.response.prepare(self.request)
        except (ConnectionError, RuntimeError) as exc:  # RuntimeError: aiohttp's "closing transport"
            raise ClientGone(str(exc)) from None
        self.is_started = True

    def add(self, payload: bytes, event: str | None = None) -> None:
        """Queue one event (``event``: its SSE event name, as the Responses API names them); it goes
        out with the next ``flush`` / ``send`` / ``done``."""
        if event is not None:
            self._pending.append(b"event: " + event.encode() + b"\n")
        self._pending.append(b"data: " + payload + b"\n\n")

    async def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            await self._write(data)

    async def send(self, payload: bytes) -> None:
        self.add(payload)
        await self.flush()

    async def done(self) -> None:
        """End the stream with ``data: [DONE]`` (chat and completions streams)."""
        self._pending.append(DONE)
        await self.end()

    async def end(self) -> None:
        """End the stream as it is (Responses streams have no ``[DONE]``)."""
        await self.flush()
        try:
            await self.response.write_eof()
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone(str(exc)) from None

    async def fail(self, error_payload: bytes, *, done: bool = True) -> None:
        """End the stream with an in-band OpenAI error object (the status line is long gone); events
        already queued go out first. ``done=False``: an ``error`` event and no ``[DONE]``."""
        try:
            self.add(error_payload, event=None if done else "error")
            await (self.done() if done else self.end())
        except ClientGone:
            pass

    async def _write(self, data: bytes) -> None:
        if not self.is_started:
            await self.start()
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ClientGone("connection closed")
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone(str(exc)) from None
