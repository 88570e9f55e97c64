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

from collections.abc import Iterable

from deepinfer.runtime.balance.types import DecodeLoad, PrefillLoad


class PrefillLoadView:
    def __init__(self) -> None:
        self._engine2report: dict[int, tuple[float, PrefillLoad]] = {}
        self._engine2routed: dict[int, list[tuple[float, float]]] = {}  # (routed at, predicted s)

    def on_report(self, now: float, load: PrefillLoad) -> None:
        self._engine2report[load.engine_id] = (now, load)
        routed = self._engine2routed.get(load.engine_id)
        if routed:
            self._engine2routed[load.engine_id] = [r for r in routed if r[0] > now]

    def on_routed(self, now: float, engine_id: int, predicted_s: float) -> None:
        self._engine2routed.setdefault(engine_id, []).append((now, predicted_s))

    def drop_engine(self, engine_id: int) -> None:
        self._engine2report.pop(engine_id, None)
        self._engine2routed.pop(engine_id, None)

    def loads(self, now: float) -> list[PrefillLoad]:
        out = []
        for engine_id, (reported_at, load) in self._engine2report.items():
            routed = self._engine2routed.get(engine_id, ())
            backlog = max(0.0, load.backlog_s - (now - reported_at)) + sum(r[1] for r in routed)
            out.append(PrefillLoad(engine_id, load.num_requests + len(routed), backlog))
        return out


class DecodeLoadView:
    def __init__(self) -> None:
        self._engine2report: dict[int, tuple[float, DecodeLoad]] = {}
        self._engine2routed: dict[int, list[tuple[float, int]]] = {}  # (routed at, KV tokens)

    def on_report(self, now: float, load: DecodeLoad) -> None:
        self._engine2report[load.engine_id] = (now, load)
        routed = self._engine2routed.get(load.engine_id)
        if routed:
            self._engine2routed[load.engine_id] = [r for r in routed if r[0] > now]

    def on_routed(self, now: float, engine_id: int, num_kv_tokens: int) -> None:
        self._engine2routed.setdefault(engine_id, []).append((now, num_kv_tokens))

    def drop_engine(self, engine_id: int) -> None:
        self._engine2report.pop(engine_id, None)
        self._engine2routed.pop(engine_id, None)

    def loads(self) -> list[DecodeLoad]:
        out = []
        for engine_id, (_, load) in self._engine2report.items():
            routed: Iterable[tuple[float, int]] = self._engine2routed.get(engine_id, ())
            if routed:
                load = load._replace(
                    num_requests=load.num_requests + len(routed),
                    num_kv_tokens=load.num_kv_tokens + sum(r[1] for r in routed),
                )
            out.append(load)
        return out
