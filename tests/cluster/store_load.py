"""A store client for the netns cluster tests, run inside one host of a NetnsCluster:

    python store_load.py CLUSTER_TOML          (then commands on stdin, one JSON answer per line)

It builds ``ClusterStore.from_cluster_config`` from the operator's cluster file, as an engine
would, and obeys one command per stdin line:

    fill N      write objects 0..N-1; {"cmd": "fill", "ok": [...], "failed": [[id, message], ...]}
    load W      start W workers: each reads a batch of known objects or writes a new one, again
                and again; {"cmd": "load"}
    stop        end the workers; {"cmd": "stop", "ops": [[op, id, t0, t1, status, message], ...]}
    verify      read back every object written so far; {"cmd": "verify", "ops": [...]}
    peers       ask every node of the cluster file whom it sees up (its heartbeat view):
                {"cmd": "peers", "node2peers": {name: [peer, ...] or null when it did not answer}}
    quit

An op's status is "HIT"/"MISS"/"DEADLINE"/"UNAVAILABLE" for reads (or "WRONG" when the bytes
differ from what was written) and "OK"/"FAILED" for writes; t0, t1 are time.monotonic() (the same
clock in every namespace of the machine). Every object's bytes follow from its id, so a read is
checked byte for byte without keeping what was written.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
import threading
import time

from deepinfer.cache.store.api import GetStatus, deadline_after
from deepinfer.cache.store.client import ClusterStore
from deepinfer.runtime import loop
from deepinfer.runtime.cluster_config import load_cluster_config
from deepinfer.transport.channels import RequestClient
from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import NodeControlReply, StatusRequest

READ_DEADLINE_S = 2.0
WRITE_DEADLINE_S = 3.0
READ_BATCH = 3
PAUSE_S = 0.01  # between a worker's ops: load, not a flood, on a 2-core machine


def key_of(object_id: int) -> bytes:
    return hashlib.sha256(f"netns-object-{object_id}".encode()).digest()[:16]


def bytes_of(object_id: int) -> bytes:
    size = 4096 + (object_id * 7919) % (160 * 1024)
    return random.Random(object_id).randbytes(size)


class Load:
    def __init__(self, store: ClusterStore):
        self.store = store
        self.written: list[int] = []  # ids whose write was acknowledged
        self.next_id = 0
        self.ops: list[list] = []
        self._rng = random.Random(7)

    async def write(self, ids: list[int]) -> list[tuple[int, bool, str]]:
        t0 = time.monotonic()
        results = await self.store.put_blocks([(key_of(i), bytes_of(i)) for i in ids], traffic_class="chat",
                                              deadline=deadline_after(WRITE_DEADLINE_S))
        t1 = time.monotonic()
        out = []
        for i, res in zip(ids, results):
            self.ops.append(["write", i, t0, t1, "OK" if res.is_ok else "FAILED", res.message])
            if res.is_ok:
                self.written.append(i)
            out.append((i, res.is_ok, res.message))
        return out

    async def read(self, ids: list[int]) -> None:
        t0 = time.monotonic()
        results = await self.store.get_blocks([key_of(i) for i in ids], deadline=deadline_after(READ_DEADLINE_S))
        t1 = time.monotonic()
        for i, res in zip(ids, results):
            status = GetStatus(res.status).name
            if res.is_hit and res.data != bytes_of(i):
                status = "WRONG"
            self.ops.append(["read", i, t0, t1, status, res.message])

    async def worker(self) -> None:
        while True:
            if self.written and self._rng.random() < 0.75:
                await self.read(self._rng.sample(self.written, min(READ_BATCH, len(self.written))))
            else:
                self.next_id += 1
                await self.write([self.next_id - 1])
            await asyncio.sleep(PAUSE_S)


async def peers_seen(config) -> dict[str, list[str] | None]:
    async def one(spec) -> list[str] | None:
        client = await RequestClient(spec.control, NodeControlReply, name=f"status-{spec.name}").start()
        try:
            return sorted((await client.request(StatusRequest(), timeout_s=1.0)).peers_up)
        except TransportError:
            return None
        finally:
            await client.close()

    return dict(zip([s.name for s in config.nodes], await asyncio.gather(*(one(s) for s in config.nodes))))


def stdin_lines(loop_: asyncio.AbstractEventLoop) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()

    def pump() -> None:
        for line in sys.stdin:
            loop_.call_soon_threadsafe(queue.put_nowait, line.strip())
        loop_.call_soon_threadsafe(queue.put_nowait, "quit")

    threading.Thread(target=pump, daemon=True).start()
    return queue


def answer(**fields) -> None:
    print(json.dumps(fields), flush=True)


async def main(path: str) -> None:
    config = load_cluster_config(path)
    store = ClusterStore.from_cluster_config(config)
    await store.start()
    load = Load(store)
    commands = stdin_lines(asyncio.get_running_loop())
    workers: list[asyncio.Task] = []
    answer(cmd="ready")
    while True:
        verb, _, arg = (await commands.get()).partition(" ")
        if verb == "fill":
            ids = list(range(load.next_id, load.next_id + int(arg)))
            load.next_id += len(ids)
            results = [r for chunk in range(0, len(ids), 8) for r in await load.write(ids[chunk:chunk + 8])]
            answer(cmd="fill", ok=[i for i, ok, _ in results if ok], failed=[[i, m] for i, ok, m in results if not ok])
        elif verb == "load":
            workers = [asyncio.create_task(load.worker()) for _ in range(int(arg))]
            answer(cmd="load")
        elif verb == "stop":
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            answer(cmd="stop", ops=load.ops)
            load.ops = []
        elif verb == "verify":
            before, load.ops = load.ops, []
            ids = list(load.written)
            for chunk in range(0, len(ids), 16):
                await load.read(ids[chunk:chunk + 16])
            answer(cmd="verify", ops=load.ops)
            load.ops = before
        elif verb == "peers":
            answer(cmd="peers", node2peers=await peers_seen(config))
        elif verb == "quit":
            break
        else:
            answer(cmd=verb, error=f"unknown command {verb!r}")
    await store.close()


if __name__ == "__main__":
    loop.run(main(sys.argv[1]))
