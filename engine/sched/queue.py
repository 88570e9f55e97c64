"""The waiting queue: lowest (priority, arrival) first, with O(log n) push/pop and lazy removal.

Preempted requests keep their original arrival index, so they go back ahead of everything that
arrived after them (fair FIFO within a priority).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from deepinfer.engine.core.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Request]] = []
        self._members: dict[str, Request] = {}
        self._num_pushes = 0  # tie-break so a re-pushed request never compares Request objects

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, request: Request) -> bool:
        return self._members.get(request.request_id) is request

    def __iter__(self) -> Iterator[Request]:
        """Members in scheduling order (sorts; for tests and stats, not the hot path)."""
        return iter(sorted(self._members.values(), key=lambda r: r.sort_key))

    def push(self, request: Request) -> None:
        if request.request_id in self._members:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        self._members[request.request_id] = request
        self._num_pushes += 1
        heapq.heappush(self._heap, (*request.sort_key, self._num_pushes, request))

    def peek(self) -> Request | None:
        self._drop_stale()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        self._drop_stale()
        request = heapq.heappop(self._heap)[3]
        del self._members[request.request_id]
        return request

    def remove(self, request: Request) -> bool:
        """Lazy removal (abort): the heap entry is skipped when it reaches the top."""
        if self._members.get(request.request_id) is request:
            del self._members[request.request_id]
            return True
        return False

    def _drop_stale(self) -> None:
        heap = self._heap
        while heap and self._members.get(heap[0][3].request_id) is not heap[0][3]:
            heapq.heappop(heap)
