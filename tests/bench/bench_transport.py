"""`deepinfer bench transport`: bulk data-plane throughput over ipc and tcp next to memcpy.

Set-up as in production: each receiver is a separate process (its own event loop, uvloop when
available) running a ``BulkReceiver`` with a ``BufferPool``; this process runs one
``BulkSender`` per transport. Transports:

- ``ipc``: ``ipc://`` with the default path (same-host cross-memory pull when the kernel allows
  it, else ZeroMQ frames; the JSON says which in ``ipc_path``),
- ``tcp``: ``tcp://127.0.0.1`` loopback, ZeroMQ frames, ``recv_into`` into the destination,
- ``ipc_frames``: ``ipc://`` forced to ZeroMQ frames (reference).

A figure = payload bytes / median time of ``--repeat`` transfers, each timed from the first
frame queued to the receiver's OK ack (ack round trip, allocation and the copy into place
included). memcpy = single-thread ``np.copyto`` of the same size. Samples are taken round-robin
(memcpy, ipc, tcp, ... per round) so load changes on a shared machine hit all alike.

JSON keys: ``{transport}_{size}_GBps``, ``memcpy_{size}_GBps``, ``{transport}_{size}_vs_memcpy``,
``ipc_path``, and ``zmq_adopt_ipc_16MiB_GBps`` (raw pyzmq keeping libzmq's frames, no copy
into a destination: what the receive-side copy costs) when 16 MiB is measured.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from deepinfer_bench.report import Report, base_parser

from deepinfer.runtime import loop as runtime_loop
from deepinfer.transport.buffers import BufferPool
from deepinfer.transport.dataplane import DEFAULT_CHUNK_BYTES, DEFAULT_WINDOW_MESSAGES, BulkReceiver, BulkSender

MiB = 1 << 20
_UNITS = {"KiB": 1 << 10, "MiB": MiB, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    for unit, factor in _UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def size_label(num_bytes: int) -> str:
    for unit, factor in reversed(_UNITS.items()):
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return f"{num_bytes}B"


class MemcpyProbe:
    """Single-thread memcpy of one size, sampled between transport samples."""

    def __init__(self, num_bytes: int):
        self.src = np.random.default_rng(0).integers(0, 255, num_bytes, dtype=np.uint8)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # fault the pages in first

    def sample(self) -> float:
        start = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - start


# ---- receiver process -------------------------------------------------------------------


async def _serve(address: str) -> None:
    pool = BufferPool(max_kept_bytes=2 << 30)
    async with BulkReceiver(address, pool=pool) as receiver:
        print(f"READY {receiver.address}", flush=True)
        reader = asyncio.create_task(asyncio.to_thread(sys.stdin.read))  # parent closes stdin -> exit
        while not reader.done():
            getter = asyncio.create_task(receiver.recv())
            await asyncio.wait([getter, reader], return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                getter.result().release()
            else:
                getter.cancel()


def receiver_main(address: str) -> None:
    runtime_loop.run(_serve(address))


def start_receiver(address: str) -> tuple[subprocess.Popen, str]:
    loader = Path(__file__).resolve().with_name("package_loader.py")
    code = (f"import runpy; loader = runpy.run_path({str(loader)!r}); "
            f"loader['load_bench_module']('transport').receiver_main({address!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if len(line) != 2 or line[0] != "READY":
        proc.kill()
        raise RuntimeError(f"bench receiver did not start (said {line!r})")
    return proc, line[1]


def stop_receiver(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- sender side --------------------------------------------------------------------------

TRANSPORTS = ("ipc", "tcp", "ipc_frames")


async def _measure(addresses: dict[str, str], sizes: list[int], repeat: int, chunk_bytes: int,
                   window: int) -> tuple[dict[str, dict[int, float]], dict[int, float], str]:
    senders = {t: await BulkSender(addresses[t], chunk_bytes=chunk_bytes, window_messages=window,
                                   default_timeout_s=120, use_cma=False if t == "ipc_frames" else None).start()
               for t in addresses}
    times: dict[str, dict[int, list[float]]] = {t: {n: [] for n in sizes} for t in [*addresses, "memcpy"]}
    try:
        for num_bytes in sizes:
            payload = np.random.default_rng(num_bytes).integers(0, 255, num_bytes, dtype=np.uint8)
            probe = MemcpyProbe(num_bytes)
            for sender in senders.values():
                await sender.send([payload])  # warm-up: connection, receiver pool, page faults
            for _ in range(repeat):
                times["memcpy"][num_bytes].append(probe.sample())
                for t, sender in senders.items():
                    times[t][num_bytes].append((await sender.send([payload])).seconds)
            del probe
        ipc_path = "cma" if "ipc" in senders and senders["ipc"].is_cma else "frames"
    finally:
        for sender in senders.values():
            await sender.close()
    gbps = {t: {n: n / statistics.median(ts) / 1e9 for n, ts in by_size.items()} for t, by_size in times.items()}
    memcpy = gbps.pop("memcpy")
    return gbps, memcpy, ipc_path


def measure(transports: list[str], sizes: list[int], repeat: int, chunk_bytes: int, window: int, tmpdir: str):
    procs, addresses = [], {}
    try:
        for t in transports:
            address = f"ipc://{tmpdir}/bench-{t}.ipc" if t.startswith("ipc") else "tcp://127.0.0.1:0"
            proc, addresses[t] = start_receiver(address)
            procs.append(proc)
        return runtime_loop.run(_measure(addresses, sizes, repeat, chunk_bytes, window))
    finally:
        for proc in procs:
            stop_receiver(proc)


def zmq_adopt_gbps(num_bytes: int, repeat: int, chunk_bytes: int, tmpdir: str) -> float:
    """Reference: the same chunking over raw pyzmq, receiver keeps libzmq's frames (no copy)."""
    code = f"""
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.rcvhwm = 4; s.bind(sys.argv[1]); print("READY", s.last_endpoint.decode(), flush=True)
while True:
    frames = s.recv_multipart(copy=False)
    if frames[1].bytes == b"end": s.send_multipart([frames[0], b"ack"])
"""
    proc = subprocess.Popen([sys.executable, "-c", code, f"ipc://{tmpdir}/bench-raw.ipc"], stdout=subprocess.PIPE,
                            text=True)
    import zmq

    try:
        address = proc.stdout.readline().split()[1]
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.sndhwm = 4
        sock.linger = 0
        sock.connect(address)
        payload = memoryview(np.ones(num_bytes, np.uint8))
        times = []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            for offset in range(0, num_bytes, chunk_bytes):
                sock.send_multipart([b"chunk", payload[offset:offset + chunk_bytes]], copy=False)
            sock.send_multipart([b"end"])
            sock.recv()
            times.append(time.perf_counter() - start)
        sock.close()
        ctx.term()
        return num_bytes / statistics.median(times[1:]) / 1e9
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("transport", "Bulk data-plane throughput (ipc, tcp loopback) next to memcpy.")
    parser.add_argument("--sizes", nargs="+", default=["1MiB", "16MiB", "256MiB"], help="payload sizes, e.g. 16MiB")
    parser.add_argument("--repeat", type=int, default=7, help="timed transfers per size and transport (median)")
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    parser.add_argument("--chunk", default=size_label(DEFAULT_CHUNK_BYTES), help="frame chunk size")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW_MESSAGES, help="chunks in flight per sender")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes]
    chunk_bytes = parse_size(args.chunk)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="di-bench-", dir="/tmp") as tmpdir:
        bulk, memcpy, ipc_path = measure(args.transports, sizes, args.repeat, chunk_bytes, args.window, tmpdir)
        adopt = zmq_adopt_gbps(16 * MiB, args.repeat, chunk_bytes, tmpdir) if 16 * MiB in sizes else None
    load = max(load_before, os.getloadavg()[0])
    report = Report(f"bulk transport: sender process -> receiver process (ipc path: {ipc_path}), frame chunk "
                    f"{size_label(chunk_bytes)}, median of {args.repeat}, {os.cpu_count()} CPUs, load {load:.1f}")
    report.figure("ipc_path", ipc_path)
    # Other processes competing for the CPUs cost every cross-process hand-off a scheduler slice:
    # record how busy the machine was so figures from different runs can be compared.
    report.figure("loadavg_1m", load)
    for n in sizes:
        label = size_label(n)
        report.figure(f"memcpy_{label}_GBps", memcpy[n])
        row = {"size": label, "memcpy GB/s": memcpy[n]}
        for t in args.transports:
            report.figure(f"{t}_{label}_GBps", bulk[t][n])
            report.figure(f"{t}_{label}_vs_memcpy", bulk[t][n] / memcpy[n])
            row[f"{t} GB/s"] = bulk[t][n]
            row[f"{t}/memcpy"] = bulk[t][n] / memcpy[n]
        report.row(**row)
    if adopt is not None:
        report.figure("zmq_adopt_ipc_16MiB_GBps", adopt)
    report.finish(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
