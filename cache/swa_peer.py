"""One engine's place among the SWA slot holders of a cluster: owner and fetcher together.

``SwaPeer`` runs on the engine's asyncio loop next to its ``SwaSlotManager``:

- owner (cache/swa_fetch.py ``SwaSlotOwner``): tells the directory which slots this engine's
  store holds (deltas, a full set now and then) and serves ``SwaFetch`` from other engines,
  pushing the packed slot over the data plane;
- fetcher (``SwaSlotFetcher``): the manager's ``prefetch`` asks the directory and pulls a slot
  another engine holds into the local store before the request is queued.

Events go to the directory as requests (``SwaSlotEvents`` -> ``SwaEventsAck``), so an engine
needs only the directory's address; a node whose event socket the directory subscribes to
passes its ``publisher`` instead. The directory drops this engine's entries on its PeerDown,
which names the same ``node_name`` and ``instance_id``.
"""

from __future__ import annotations

import os
import random
import socket

import zmq.asyncio

from deepinfer.cache.swa_fetch import SwaSlotFetcher, SwaSlotOwner
from deepinfer.cache.swa_store import SwaSlotStore
from deepinfer.transport.channels import EventPublisher


def default_node_name() -> str:
    """Unique per process on a host: what the directory lists as this engine."""
    return f"{socket.gethostname()}-{os.getpid()}"


class SwaPeer:
    def __init__(self, store: SwaSlotStore, *, directory_address: str, node_name: str | None = None,
                 instance_id: int | None = None, host: str = "127.0.0.1", publisher: EventPublisher | None = None,
                 ctx: zmq.asyncio.Context | None = None, publish_interval_s: float = 0.05,
                 resync_interval_s: float = 2.0) -> None:
        """``host``: the interface other engines reach this one on (its fetch server and slot
        receiver bind free TCP ports there)."""
        self.node_name = node_name or default_node_name()
        self.instance_id = instance_id if instance_id is not None else random.getrandbits(48)
        self.owner = SwaSlotOwner(store, node_name=self.node_name, instance_id=self.instance_id,
                                  fetch_address=f"tcp://{host}:*", publisher=publisher,
                                  directory_address=None if publisher is not None else directory_address,
                                  ctx=ctx, publish_interval_s=publish_interval_s, resync_interval_s=resync_interval_s)
        self.fetcher = SwaSlotFetcher(store, node_name=self.node_name, directory_address=directory_address,
                                      receive_address=f"tcp://{host}:*", ctx=ctx)
        self._is_started = False

    async def start(self) -> SwaPeer:
        try:
            await self.owner.start()
            await self.fetcher.start()
        except BaseException:
            await self.close()
            raise
        self._is_started = True
        return self

    async def publish_now(self) -> None:
        """Send the store's changes now (tests; the owner also does it every interval)."""
        await self.owner.publish_now()

    async def close(self) -> None:
        await self.fetcher.close()
        await self.owner.close()
