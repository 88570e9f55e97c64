"""`deepinfer storage`: one storage node of the erasure-coded KV cache cluster.

Prints one line ``deepinfer storage: NAME listening on ADDRESS (N fragments, B bytes)`` once it
serves (scripts and tests wait for it), then runs until SIGTERM/SIGINT, on which it finishes
in-flight requests, persists its index and exits 0.

Test-only options (hidden from --help; never use them in production):
  --debug-delay-ms MS     sleep MS before answering every request (a slow node, for hedging tests)
  --debug-hooks           accept DebugSet requests: set the node's clock (TTL tests) and delay
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import sys
from pathlib import Path

from deepinfer.bin.cli import CliError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1}
for i, p in enumerate("kmgtp", start=1):
    _UNIT[p] = _UNIT[p + "b"] = 1000**i
    _UNIT[p + "i"] = _UNIT[p + "ib"] = 1024**i


def parse_size(text: str) -> int:
    """'10GiB', '500GB', '1.5T', '4096' -> bytes."""
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNIT:
        raise CliError(f"--capacity {text!r} is not a size like 500GiB, 20TB or 1048576")
    return int(float(match.group(1)) * _UNIT[match.group(2).lower()])


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name,
        help="run a storage node of the KV cache cluster",
        description="Run one storage node: erasure-coded fragments on local disk, LRU GC, TTL per traffic class.",
    )
    p.add_argument("--dir", required=True, help="directory holding this node's fragments and index")
    p.add_argument("--listen", default="tcp://127.0.0.1:7600", help="ZeroMQ address to listen on (port 0: any free port)")
    p.add_argument("--capacity", default="10GiB", help="bytes this node may hold, e.g. 500GiB")
    p.add_argument("--high-watermark", type=float, default=0.90, help="GC starts when used bytes pass this fraction of capacity")
    p.add_argument("--low-watermark", type=float, default=0.80, help="GC evicts least recently used fragments down to this fraction")
    p.add_argument("--ttl", default="agent=3d,chat=7d", help="retention per traffic class, e.g. agent=3d,chat=7d,default=7d")
    p.add_argument("--name", default="", help="node name in stats and metrics (default: the directory's name)")
    p.add_argument("--gc-interval", type=float, default=1.0, help="seconds between GC passes")
    p.add_argument("--fsync", action="store_true", help="fsync every fragment file (slower; the cache survives power loss)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for the metrics endpoint")
    p.add_argument("--debug-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--debug-hooks", action="store_true", help=argparse.SUPPRESS)
    return p


def _config(args):
    from deepinfer.cache.store.gc import parse_ttl_spec
    from deepinfer.cache.store.node import StorageNodeConfig

    try:
        ttl = parse_ttl_spec(args.ttl)
    except ValueError as exc:
        raise CliError(f"--ttl: {exc}") from None
    if not 0.0 < args.low_watermark <= args.high_watermark <= 1.0:
        raise CliError(f"watermarks need 0 < low <= high <= 1, got low={args.low_watermark} high={args.high_watermark}")
    return StorageNodeConfig(
        dir=Path(args.dir),
        listen=args.listen,
        capacity_bytes=parse_size(args.capacity),
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        ttl=ttl,
        name=args.name,
        gc_interval_s=args.gc_interval,
        fsync=args.fsync,
        debug_delay_ms=args.debug_delay_ms,
        debug_hooks=args.debug_hooks,
    )


async def _serve(config, metrics_host: str, metrics_port: int) -> int:
    from deepinfer.cache.store.node import StorageNode

    node = StorageNode(config)
    try:
        address = await node.start()
    except OSError as exc:
        raise CliError(str(exc)) from None
    runner = None
    if metrics_port:
        from deepinfer.cache.store.metrics import registry_for, serve_metrics

        runner = await serve_metrics(registry_for(node.stats), metrics_host, metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"deepinfer storage: {node.name} listening on {address} "
        f"({node.store.num_fragments} fragments, {node.store.used_bytes} bytes)",
        flush=True,
    )
    await stop.wait()
    if runner is not None:
        await runner.cleanup()
    await node.stop()
    return 0


def run(args) -> int:
    from deepinfer import envs
    from deepinfer.runtime.loop import run as run_loop

    config = _config(args)
    config.dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=envs.get().log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_loop(_serve(config, args.metrics_host, args.metrics_port))
