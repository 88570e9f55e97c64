"""Per-request delta queues between the step loop and ``AsyncEngine.generate`` / ``submit``."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from deepinfer.engine.api.outputs import RequestOutput
from deepinfer.engine.text.output_processor import merge_output


class DeltaQueue:
    """One request's deltas, pushed by the step loop and pulled by its ``RequestStream``."""

    __slots__ = ("items", "ready", "is_done")

    def __init__(self) -> None:
        self.items: deque[RequestOutput | BaseException] = deque()
        self.ready = asyncio.Event()
        self.is_done = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` unless it has ended."""
        if not self.is_done:
            self.is_done = True
            self.put(error)

    async def get(self) -> RequestOutput:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        item = self.items.popleft()
        if isinstance(item, BaseException):
            raise item
        # coalesce deltas that piled up while the consumer was busy (an error stays queued)
        while self.items and not item.finished and isinstance(self.items[0], RequestOutput):
            item = merge_output(merge_output(None, item), self.items.popleft())
        return item


class RequestStream:
    """The deltas of one queued request (``AsyncEngine.submit``); ``close()`` aborts it unless
    it has finished."""

    __slots__ = ("_release", "request_id", "_queue", "_is_closed")

    def __init__(self, request_id: str, queue: DeltaQueue, release: Callable[[str, DeltaQueue], None]) -> None:
        self._release = release  # the engine forgets the queue (and aborts the request if unfinished)
        self.request_id = request_id
        self._queue = queue
        self._is_closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._is_closed:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:
            self.close()
            raise
        if out.finished:
            self.close()
        return out

    def close(self) -> None:
        if not self._is_closed:
            self._is_closed = True
            self._release(self.request_id, self._queue)
