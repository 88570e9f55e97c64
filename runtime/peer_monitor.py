"""Drive a ``PeerTable``: stamp heartbeats, sweep for suspects, probe them, report the verdicts.

    monitor = PeerMonitor(PeerTable(settings), name="gateway", on_events=emit)
    monitor.add_peer("decode-0", control="ipc:///.../decode-0.control")
    await monitor.start()
    await monitor.observe(heartbeat)      # from whatever subscribes to the peers' events

Every half heartbeat interval the table is swept; each suspect is asked directly, on its node
control channel, for its status (``StatusRequest`` -> ``NodeStatus`` with its instance id). A
silent host can be a busy host, and a busy *observer* can be the slow one: the probe's answer,
or any heartbeat that arrives while it is out, keeps the peer up. Only a probe that stays
unanswered for ``probe_timeout_s`` declares it down. Peers without a control address cannot
be probed: their suspicion is death. ``suspect(name)`` probes at once on outside evidence (a
local supervisor saw the process exit), so a killed local engine is down after one probe
timeout instead of a whole suspicion window.

``on_events(events)`` (a coroutine) gets every PeerUp/PeerDown, in order, from one place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq.asyncio

from deepinfer.runtime.peer_table import PeerEventMsg, PeerTable, ProbeRequest, Sweep
from deepinfer.transport.channels import RequestClient
from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import Heartbeat, Leave, NodeControlReply, NodeStatus, StatusRequest
from deepinfer.transport.security import CurveClientKeys, CurveKeyPair

log = logging.getLogger(__name__)

EventsHandler = Callable[[list[PeerEventMsg]], Awaitable[None]]


@dataclass(slots=True)
class _Probed:
    control: str
    curve_public_key: bytes | None
    client: RequestClient | None = None


class PeerMonitor:
    def __init__(self, table: PeerTable, *, name: str, on_events: EventsHandler,
                 ctx: zmq.asyncio.Context | None = None, curve_keypair: CurveKeyPair | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.table = table
        self.name = name
        self._on_events = on_events
        self._ctx = ctx
        self._curve_keypair = curve_keypair
        self._clock = clock
        self._peers: dict[str, _Probed] = {}
        self._sweeper: asyncio.Task | None = None
        self._probes: set[asyncio.Task] = set()
        self.num_probes = 0
        self.num_probes_answered = 0

    def add_peer(self, name: str, control: str, curve_public_key: bytes | None = None) -> None:
        """Where ``name`` answers probes (its node control channel); "" = it cannot be probed."""
        if control:
            self._peers[name] = _Probed(control, curve_public_key)

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_loop(), name=f"{self.name}-sweep")

    async def close(self) -> None:
        tasks = [t for t in (self._sweeper, *self._probes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sweeper = None
        for peer in self._peers.values():
            if peer.client is not None:
                await peer.client.close()
                peer.client = None

    async def observe(self, msg: Heartbeat | Leave) -> None:
        now = self._clock()
        events = self.table.observe(msg, now) if isinstance(msg, Heartbeat) else self.table.leave(msg, now)
        await self._report(events)

    async def sweep_now(self) -> None:
        await self._dispatch(self.table.sweep(self._clock()))

    async def suspect(self, name: str) -> None:
        """Probe ``name`` now instead of waiting for its silence (e.g. its process exited)."""
        if self._sweeper is not None:
            await self._dispatch(self.table.suspect(name, self._clock()))

    async def _dispatch(self, sweep: Sweep) -> None:
        for probe in sweep.probes:
            if probe.name in self._peers:
                task = asyncio.create_task(self._probe(probe), name=f"{self.name}-probe-{probe.name}")
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)
            else:
                sweep.events += self.table.probe_failed(probe, self._clock())
        await self._report(sweep.events)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.table.settings.interval_s / 2)
            await self.sweep_now()

    async def _probe(self, probe: ProbeRequest) -> None:
        self.num_probes += 1
        timeout_s = self.table.settings.probe_timeout_s
        state = self.table.get(probe.name)
        silence_s = probe.sent_at - state.last_seen if state is not None else 0.0
        log.info("%s: %s silent for %.2fs; probing it (timeout %gs)", self.name, probe.name, silence_s, timeout_s)
        try:
            reply = await (await self._client(probe.name)).request(StatusRequest(), timeout_s=timeout_s)
        except (TransportError, OSError) as exc:
            log.warning("%s: probe of %s unanswered: %s", self.name, probe.name, exc)
            await self._report(self.table.probe_failed(probe, self._clock()))
            return
        if not isinstance(reply, NodeStatus):
            await self._report(self.table.probe_failed(probe, self._clock()))
            return
        self.num_probes_answered += 1
        await self._report(self.table.probe_answered(probe, reply.instance_id, self._clock()))

    async def _client(self, name: str) -> RequestClient:
        peer = self._peers[name]
        if peer.client is None:
            curve = None
            if self._curve_keypair is not None and peer.curve_public_key:
                curve = CurveClientKeys(self._curve_keypair, server_public=peer.curve_public_key)
            peer.client = await RequestClient(peer.control, NodeControlReply, ctx=self._ctx, curve=curve,
                                              name=f"{self.name}-probe-{name}").start()
        return peer.client

    async def _report(self, events: list[PeerEventMsg]) -> None:
        if events:
            await self._on_events(events)
