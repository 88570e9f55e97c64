"""``X-Request-Id`` on every response: the client's own id when it sent a usable one, else a new one.

The id is also the prefix of the request's engine request ids (``engine_request_id``), so a
line any part of the stack logs about the request can be found by the id the client holds:

    client  X-Request-Id: job-17            engine ids  job-17.chatcmpl-3f2a...-0, ...-1
    (none)  -> generated 9c41e0...          engine ids  9c41e0....chatcmpl-77b1...-0

A client id is used as sent when it is 1-128 characters of ``[A-Za-z0-9._:@/+=-]``; anything
else (control characters, a header meant to break logs) is replaced by a generated id.
"""

from __future__ import annotations

import re
import uuid

from aiohttp import web

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
