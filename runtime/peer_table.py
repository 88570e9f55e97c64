"""Failure detector as a pure policy: heartbeats and the clock in, PeerUp/PeerDown events out.

A peer is *up* from its first heartbeat. It is marked *down* when

- no heartbeat arrived for ``missed_beats`` intervals (``DownReason.MISSED_BEATS``),
- a heartbeat arrives with a different ``instance_id`` (the process restarted: PeerDown of the
  old instance with ``RESTARTED``, then PeerUp of the new one — never confused with its
  previous life), or
- it said goodbye with ``Leave`` (``LEFT``).

Beats from an instance that was replaced or left are ignored, so a delayed packet cannot
resurrect a dead instance. No sockets, no asyncio: ``runtime.heartbeat`` drives it.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.transport.protocol import DownReason, Heartbeat, Leave, PeerDown, PeerUp, Role

_MAX_RETIRED_PER_PEER = 8

PeerEventMsg = PeerUp | PeerDown


@dataclass(slots=True)
class PeerState:
    name: str
    role: Role
    instance_id: int
    last_seen: float
    last_seq: int
    is_up: bool
    is_draining: bool


class PeerTable:
    def __init__(self, interval_s: float, missed_beats: int):
        assert interval_s > 0 and missed_beats >= 1, (interval_s, missed_beats)
        self.down_after_s = interval_s * missed_beats
        self._peers: dict[str, PeerState] = {}
        self._retired: dict[str, list[int]] = {}  # name -> instance ids that must stay dead

    def observe(self, beat: Heartbeat, now: float) -> list[PeerEventMsg]:
        if beat.instance_id in self._retired.get(beat.node_name, ()):
            return []
        state = self._peers.get(beat.node_name)
        events: list[PeerEventMsg] = []
        if state is not None and state.instance_id != beat.instance_id:
            if state.is_up:
                events.append(_down(state, DownReason.RESTARTED))
            self._retire(state)
            state = None
        if state is None:
            state = PeerState(beat.node_name, beat.role, beat.instance_id, now, beat.seq, False, beat.is_draining)
            self._peers[beat.node_name] = state
        state.last_seen = now
        state.last_seq = beat.seq
        state.is_draining = beat.is_draining
        if not state.is_up:
            state.is_up = True
            events.append(PeerUp(node_name=state.name, role=state.role, instance_id=state.instance_id))
        return events

    def leave(self, msg: Leave, now: float) -> list[PeerEventMsg]:
        state = self._peers.get(msg.node_name)
        if state is None or state.instance_id != msg.instance_id:
            return []
        self._retire(state)
        del self._peers[msg.node_name]
        return [_down(state, DownReason.LEFT)] if state.is_up else []

    def sweep(self, now: float) -> list[PeerEventMsg]:
        events: list[PeerEventMsg] = []
        for state in self._peers.values():
            if state.is_up and now - state.last_seen > self.down_after_s:
                state.is_up = False
                events.append(_down(state, DownReason.MISSED_BEATS))
        return events

    def is_up(self, name: str) -> bool:
        state = self._peers.get(name)
        return state is not None and state.is_up

    def get(self, name: str) -> PeerState | None:
        return self._peers.get(name)

    def peers_up(self) -> list[str]:
        return sorted(name for name, state in self._peers.items() if state.is_up)

    def _retire(self, state: PeerState) -> None:
        retired = self._retired.setdefault(state.name, [])
        retired.append(state.instance_id)
        del retired[:-_MAX_RETIRED_PER_PEER]


def _down(state: PeerState, reason: DownReason) -> PeerDown:
    return PeerDown(node_name=state.name, role=state.role, instance_id=state.instance_id, reason=reason)
