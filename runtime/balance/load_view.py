"""A gateway's picture of engine load between heartbeats: last report + what it routed since.

Engines report load on a heartbeat (every ~100 ms); routing decisions happen in between and
several gateways may route at once. Each gateway therefore keeps, per engine, the last report
and the work it has itself sent after that report's timestamp:

    report at T: backlog 4.0 s, 3 requests        routed by this gateway at T+0.02, T+0.05
    view at now: backlog = max(0, 4.0 - (now - T)) + est(T+0.02) + est(T+0.05), requests = 3 + 2

The report's backlog is aged by the time since it was taken (a busy engine burns its backlog at
one second per second). Work other gateways routed since T is invisible until the next report:
that staleness is the price of not coordinating gateways, and the reason the prefill router
keeps an explicit imbalance bound rather than trusting small load differences.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from deepinfer.runtime.balance.types import DecodeLoad, PrefillLoad


class _EngineView:
    """The last report of one engine plus what this gateway routed to it after that report."""

    __slots__ = ("reported_at", "load", "routed", "routed_sum")

    def __init__(self, reported_at: float, load) -> None:
        self.reported_at = reported_at
        self.load = load
        self.routed: deque[tuple[float, float]] = deque()  # (routed at, amount), in time order
        self.routed_sum = 0.0

    def report(self, now: float, load) -> None:
        self.reported_at, self.load = now, load
        routed = self.routed
        while routed and routed[0][0] <= now:  # the report already counts these
            self.routed_sum -= routed.popleft()[1]
        if not routed:
            self.routed_sum = 0.0  # no drift from float subtraction

    def add(self, now: float, amount: float) -> None:
        self.routed.append((now, amount))
        self.routed_sum += amount


class _LoadView:
    def __init__(self) -> None:
        self._engine2view: dict[int, _EngineView] = {}

    def on_report(self, now: float, load) -> None:
        view = self._engine2view.get(load.engine_id)
        if view is None:
            self._engine2view[load.engine_id] = _EngineView(now, load)
        else:
            view.report(now, load)

    def on_reports(self, now: float, loads: Iterable) -> None:
        for load in loads:
            self.on_report(now, load)

    def drop_engine(self, engine_id: int) -> None:
        self._engine2view.pop(engine_id, None)


class PrefillLoadView(_LoadView):
    def on_routed(self, now: float, engine_id: int, predicted_s: float) -> None:
        """This gateway sent ``engine_id`` a prefill predicted to take ``predicted_s`` seconds."""
        view = self._engine2view.get(engine_id)
        if view is not None:
            view.add(now, predicted_s)

    def loads(self, now: float) -> list[PrefillLoad]:
        return [
            PrefillLoad(
                e,
                v.load.num_requests + len(v.routed),
                max(0.0, v.load.backlog_s - (now - v.reported_at)) + v.routed_sum,
            )
            for e, v in self._engine2view.items()
        ]


class DecodeLoadView(_LoadView):
    def on_routed(self, now: float, engine_id: int, num_kv_tokens: int) -> None:
        """This gateway chose ``engine_id`` as the handoff target of a ``num_kv_tokens`` prompt."""
        view = self._engine2view.get(engine_id)
        if view is not None:
            view.add(now, num_kv_tokens)

    def loads(self) -> list[DecodeLoad]:
        return [
            v.load._replace(
                num_requests=v.load.num_requests + len(v.routed),
                num_kv_tokens=v.load.num_kv_tokens + int(v.routed_sum),
            ) if v.routed else v.load
            for v in self._engine2view.values()
        ]
