"""Peer liveness as a pure policy: heartbeats, probe results and the clock in, PeerUp/PeerDown out.

A peer is *up* from its first heartbeat. Then:

- silent long enough to be suspected (runtime/failure_detector.py: phi accrual between a floor
  and a cap), it is *probed*: ``sweep`` returns a ``ProbeRequest`` and the driver asks the peer
  directly (runtime/peer_monitor.py). A probe answered by the same instance, or any heartbeat
  arriving meanwhile, clears the suspicion; an unanswered probe marks it down
  (``DownReason.MISSED_BEATS``). With ``probe_timeout_s = 0`` suspicion is death;
- a heartbeat (or probe answer) with a different ``instance_id`` means the process restarted:
  PeerDown of the old instance with ``RESTARTED``, and the new one comes up with its first
  heartbeat — never confused with its previous life;
- ``Leave`` (a graceful stop) marks it down at once (``LEFT``), and so does ``exited`` (its
  local supervisor saw the process exit: ``EXITED``, no probe needed).

Beats from an instance that was replaced or left are ignored, so a delayed packet cannot
resurrect a dead instance. No sockets, no asyncio: ``runtime.peer_monitor`` drives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from deepinfer.runtime.failure_detector import ArrivalWindow, DetectorSettings, is_suspect
from deepinfer.transport.protocol import DownReason, Heartbeat, Leave, PeerDown, PeerUp, Role

_MAX_RETIRED_PER_PEER = 8

PeerEventMsg = PeerUp | PeerDown


@dataclass(slots=True)
class PeerState:
    name: str
    role: Role
    instance_id: int
    last_seen: float  # the last sign of life: a heartbeat or an answered probe
    last_seq: int
    is_up: bool
    is_draining: bool
    arrivals: ArrivalWindow
    probe_sent_at: float | None = None  # set while the peer is suspected and a probe is out


class ProbeRequest(NamedTuple):
    """Ask ``name`` whether instance ``instance_id`` is alive; report back with ``sent_at``."""

    name: str
    instance_id: int
    sent_at: float


@dataclass(slots=True)
class Sweep:
    events: list[PeerEventMsg] = field(default_factory=list)
    probes: list[ProbeRequest] = field(default_factory=list)


class PeerTable:
    def __init__(self, settings: DetectorSettings):
        self.settings = settings
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
            state = PeerState(beat.node_name, beat.role, beat.instance_id, now, beat.seq, False, beat.is_draining,
                              ArrivalWindow(self.settings))
            self._peers[beat.node_name] = state
        elif not state.is_up:
            state.arrivals = ArrivalWindow(self.settings)  # back (partition healed): the gap is no jitter
        state.arrivals.record(now)
        state.last_seen = max(state.last_seen, now)
        state.last_seq = beat.seq
        state.is_draining = beat.is_draining
        state.probe_sent_at = None  # it spoke: whatever the probe says, it is not suspected any more
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

    def exited(self, name: str) -> list[PeerEventMsg]:
        """The process of ``name`` exited (its supervisor saw it): the instance up now is dead for good."""
        state = self._peers.get(name)
        if state is None or not state.is_up:
            return []
        self._retire(state)
        del self._peers[name]
        return [_down(state, DownReason.EXITED)]

    def sweep(self, now: float) -> Sweep:
        """Suspects to probe (or, without probes, to declare down) as of ``now``."""
        result = Sweep()
        for state in self._peers.values():
            if state.is_up and state.probe_sent_at is None and \
                    is_suspect(self.settings, state.arrivals, now - state.last_seen):
                self._suspect(state, now, result)
        return result

    def suspect(self, name: str, now: float) -> Sweep:
        """Suspect ``name`` now, whatever its silence: outside evidence (its local supervisor saw
        the process exit). The probe (or, without probes, this call) decides."""
        result = Sweep()
        state = self._peers.get(name)
        if state is not None and state.is_up and state.probe_sent_at is None:
            self._suspect(state, now, result)
        return result

    def _suspect(self, state: PeerState, now: float, result: Sweep) -> None:
        if self.settings.probe_timeout_s > 0:
            state.probe_sent_at = now
            result.probes.append(ProbeRequest(state.name, state.instance_id, now))
        else:
            state.is_up = False
            result.events.append(_down(state, DownReason.MISSED_BEATS))

    def probe_answered(self, probe: ProbeRequest, answered_instance_id: int, now: float) -> list[PeerEventMsg]:
        """The peer answered ``probe`` as instance ``answered_instance_id``."""
        state = self._probed(probe)
        if state is None:
            return []
        state.probe_sent_at = None
        if answered_instance_id == state.instance_id:
            state.last_seen = max(state.last_seen, now)  # alive: the silence clock starts again
            return []
        # another process answers at its address: this instance is gone for good (the new one
        # comes up with its first heartbeat)
        self._retire(state)
        del self._peers[state.name]
        return [_down(state, DownReason.RESTARTED)]

    def probe_failed(self, probe: ProbeRequest, now: float) -> list[PeerEventMsg]:
        """No answer to ``probe`` within the probe timeout."""
        state = self._probed(probe)
        if state is None:
            return []
        state.probe_sent_at = None
        if state.last_seen > probe.sent_at:
            return []  # heard from since the probe went out (observer was the slow one)
        state.is_up = False
        return [_down(state, DownReason.MISSED_BEATS)]

    def is_up(self, name: str) -> bool:
        state = self._peers.get(name)
        return state is not None and state.is_up

    def is_suspected(self, name: str) -> bool:
        state = self._peers.get(name)
        return state is not None and state.is_up and state.probe_sent_at is not None

    def get(self, name: str) -> PeerState | None:
        return self._peers.get(name)

    def peers_up(self) -> list[str]:
        return sorted(name for name, state in self._peers.items() if state.is_up)

    def _probed(self, probe: ProbeRequest) -> PeerState | None:
        """The peer's state if ``probe`` is still the question outstanding for that instance."""
        state = self._peers.get(probe.name)
        if state is None or state.instance_id != probe.instance_id or not state.is_up:
            return None
        return state if state.probe_sent_at == probe.sent_at else None

    def _retire(self, state: PeerState) -> None:
        retired = self._retired.setdefault(state.name, [])
        retired.append(state.instance_id)
        del retired[:-_MAX_RETIRED_PER_PEER]


def _down(state: PeerState, reason: DownReason) -> PeerDown:
    return PeerDown(node_name=state.name, role=state.role, instance_id=state.instance_id, reason=reason)
