"""`deepinfer bench transport`: bulk data-plane throughput over ipc and tcp next to memcpy.

Set-up as in production: the receiver is a separate process (its own event loop, uvloop when
available) running a ``BulkReceiver`` with a ``BufferPool``; this process runs the
``BulkSender``. One figure = payload bytes / median time of ``--repeat`` sequential transfers,
each timed from the first frame queued to the receiver's OK ack (so it includes the ack round
trip, the receiver's allocation and its copy into place). memcpy = median single-thread
``np.copyto`` of the same size, measured in the same run.

JSON keys: ``{ipc,tcp}_{size}_GBps``, ``memcpy_{size}_GBps``, ``{ipc,tcp}_{size}_vs_memcpy``,
plus ``zmq_adopt_ipc_16MiB_GBps`` (reference: raw pyzmq, frames kept where libzmq put them,
no copy into a destination) when 16 MiB is among the sizes.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

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


def memcpy_gbps(num_bytes: int, repeat: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    times = []
    for _ in range(max(3, repeat)):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


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
    code = ("from deepinfer.bin.bench import load_bench_module; "
            f"load_bench_module('transport').receiver_main({address!r})")
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


async def _measure(address: str, sizes: list[int], repeat: int, chunk_bytes: int, window: int) -> dict[int, float]:
    gbps = {}
    async with BulkSender(address, chunk_bytes=chunk_bytes, window_messages=window, default_timeout_s=120) as sender:
        for num_bytes in sizes:
            payload = np.random.default_rng(num_bytes).integers(0, 255, num_bytes, dtype=np.uint8)
            await sender.send([payload])  # warm-up: connection, receiver pool, page faults
            times = [(await sender.send([payload])).seconds for _ in range(repeat)]
            gbps[num_bytes] = num_bytes / statistics.median(times) / 1e9
    return gbps


def bulk_gbps(transport: str, sizes: list[int], repeat: int, chunk_bytes: int, window: int, tmpdir: str) -> dict[int, float]:
    address = f"ipc://{tmpdir}/bench-bulk.ipc" if transport == "ipc" else "tcp://127.0.0.1:0"
    proc, bound = start_receiver(address)
    try:
        return runtime_loop.run(_measure(bound, sizes, repeat, chunk_bytes, window))
    finally:
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
    parser.add_argument("--repeat", type=int, default=5, help="timed transfers per size (median is reported)")
    parser.add_argument("--transports", nargs="+", default=["ipc", "tcp"], choices=["ipc", "tcp"])
    parser.add_argument("--chunk", default=size_label(DEFAULT_CHUNK_BYTES), help="data-plane chunk size")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW_MESSAGES, help="chunks in flight per sender")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes]
    chunk_bytes = parse_size(args.chunk)
    report = Report(f"bulk transport: sender process -> receiver process, chunk {size_label(chunk_bytes)}, "
                    f"median of {args.repeat}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-") as tmpdir:
        memcpy = {n: memcpy_gbps(n, args.repeat) for n in sizes}
        bulk = {t: bulk_gbps(t, sizes, args.repeat, chunk_bytes, args.window, tmpdir) for t in args.transports}
        adopt = zmq_adopt_gbps(16 * MiB, args.repeat, chunk_bytes, tmpdir) if 16 * MiB in sizes else None
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
