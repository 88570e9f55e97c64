"""`deepinfer storage`: one storage node of the erasure-coded KV cache cluster, and its tools.

    deepinfer storage --dir D --listen ADDR [--cluster members.json]   run a node
    deepinfer storage --cluster members.json status                    node states, fragments, repair
    deepinfer storage --cluster members.json members add NAME ADDR     edit the membership record
                                                     members drain|up|down|remove NAME
(options before the action: argparse takes the action's words together)

A node prints one line ``deepinfer storage: NAME listening on ADDRESS (N fragments, B bytes)``
once it serves (scripts and tests wait for it), then runs until SIGTERM/SIGINT, on which it
finishes in-flight requests, persists its index and exits 0. With ``--cluster`` (the membership
file, cache/store/membership.py) it also repairs: rebuilds missing fragments, moves fragments to
the nodes their groups now rank, and follows changes of the file.

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


def parse_size(text: str, flag: str = "--capacity") -> int:
    """'10GiB', '500GB', '1.5T', '4096' -> bytes."""
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNIT:
        raise CliError(f"{flag} {text!r} is not a size like 500GiB, 20TB or 1048576")
    return int(float(match.group(1)) * _UNIT[match.group(2).lower()])


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name,
        help="run a storage node of the KV cache cluster",
        description="Run one storage node: erasure-coded fragments on local disk, LRU GC, TTL per traffic class.",
    )
    p.add_argument("action", nargs="?", default="serve", choices=["serve", "status", "members"],
                   help="serve (default): run a node; status: print the cluster's nodes; members: edit the membership")
    p.add_argument("member_args", nargs="*", metavar="ARG",
                   help="for members: add NAME ADDRESS | drain NAME | up NAME | down NAME | remove NAME")
    p.add_argument("--dir", default="", help="directory holding this node's fragments and index (serve)")
    p.add_argument("--cluster", default="",
                   help="membership file (JSON: epoch, ec, nodes with name/address/state); a node with it repairs")
    p.add_argument("--listen", default="tcp://127.0.0.1:7600", help="ZeroMQ address to listen on (port 0: any free port)")
    p.add_argument("--capacity", default="10GiB", help="bytes this node may hold, e.g. 500GiB")
    p.add_argument("--high-watermark", type=float, default=0.90, help="GC starts when used bytes pass this fraction of capacity")
    p.add_argument("--low-watermark", type=float, default=0.80, help="GC evicts least recently used fragments down to this fraction")
    p.add_argument("--ttl", default="agent=3d,chat=7d", help="retention per traffic class, e.g. agent=3d,chat=7d,default=7d")
    p.add_argument("--name", default="", help="node name in stats and metrics (default: the directory's name)")
    p.add_argument("--gc-interval", type=float, default=1.0, help="seconds between GC passes")
    p.add_argument("--audit-interval", type=float, default=60.0, help="seconds between repair audits of every object")
    p.add_argument("--audit-rate", type=float, default=2000.0, help="objects per second the repair audit checks at most")
    p.add_argument("--repair-rate", default="200MB", help="repair traffic per second at most (decode reads + writes), e.g. 200MB")
    p.add_argument("--audit-min-age", type=float, default=2.0,
                   help="seconds after a write before the audit judges its object (the write's other "
                        "fragments may still be on their way; hinted repairs do not wait)")
    p.add_argument("--repair-retry", type=float, default=1.0, help="first wait before an object still short is tried again")
    p.add_argument("--membership-poll", type=float, default=1.0, help="seconds between checks of the --cluster file")
    p.add_argument("--scrub-interval", type=float, default=3600.0, help="seconds between checksum scrubs of every fragment")
    p.add_argument("--scrub-rate", default="50MB", help="bytes per second the scrub reads at most, e.g. 50MB")
    p.add_argument("--fsync", action="store_true", help="fsync every fragment file (slower; the cache survives power loss)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for the metrics endpoint")
    p.add_argument("--admin-from", default="",
                   help="without CURVE, also accept admin messages (RunGc, ...) from these networks, e.g. 10.0.0.0/8 "
                        "or 'any' (default: loopback only)")
    p.add_argument("--curve-secret-key", default="",
                   help="this node's CURVE .key_secret file: clients must speak CURVE; only admitted keys may administer")
    p.add_argument("--curve-client-keys", default="",
                   help="with --curve-secret-key: a directory of client .key files (or comma-separated Z85 keys) "
                        "admitted; default any CURVE client (then admin messages are refused)")
    p.add_argument("--debug-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--debug-hooks", action="store_true", help=argparse.SUPPRESS)
    return p


def _config(args):
    from deepinfer.cache.store.gc import parse_ttl_spec
    from deepinfer.cache.store.node import StorageNodeConfig
    from deepinfer.cache.store.repair import RepairConfig
    from deepinfer.cache.store.scrub import ScrubConfig

    if not args.dir:
        raise CliError("--dir is required to run a storage node")
    for flag, value in (("--audit-interval", args.audit_interval), ("--audit-rate", args.audit_rate),
                        ("--repair-retry", args.repair_retry), ("--membership-poll", args.membership_poll),
                        ("--scrub-interval", args.scrub_interval)):  # fmt: skip
        if not value > 0:
            raise CliError(f"{flag} must be positive, got {value}")
    if not args.audit_min_age >= 0:
        raise CliError(f"--audit-min-age must be >= 0, got {args.audit_min_age}")
    repair = RepairConfig(audit_interval_s=args.audit_interval, audit_keys_per_s=args.audit_rate,
                          repair_bytes_per_s=parse_size(args.repair_rate, "--repair-rate"), retry_s=args.repair_retry,
                          membership_poll_s=args.membership_poll, audit_min_age_s=args.audit_min_age)  # fmt: skip
    scrub = ScrubConfig(interval_s=args.scrub_interval, bytes_per_s=parse_size(args.scrub_rate, "--scrub-rate"))

    try:
        ttl = parse_ttl_spec(args.ttl)
    except ValueError as exc:
        raise CliError(f"--ttl: {exc}") from None
    if not 0.0 < args.low_watermark <= args.high_watermark <= 1.0:
        raise CliError(f"watermarks need 0 < low <= high <= 1, got low={args.low_watermark} high={args.high_watermark}")
    admin, curve, client_keys = _security(args)
    return StorageNodeConfig(
        dir=Path(args.dir),
        listen=args.listen,
        capacity_bytes=parse_size(args.capacity),
        membership_file=Path(args.cluster) if args.cluster else None,
        repair=repair,
        scrub=scrub,
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        ttl=ttl,
        name=args.name,
        gc_interval_s=args.gc_interval,
        fsync=args.fsync,
        admin=admin,
        curve=curve,
        curve_client_keys=client_keys,
        debug_delay_ms=args.debug_delay_ms,
        debug_hooks=args.debug_hooks,
    )


def _security(args):
    """(AdminPolicy, CurveServerKeys | None, admitted client keys) from the command line."""
    from deepinfer.cache.store.admin_policy import AdminPolicy, parse_networks
    from deepinfer.transport import security

    try:
        networks = parse_networks(args.admin_from)
    except ValueError as exc:
        raise CliError(f"--admin-from: {exc}") from None
    if not args.curve_secret_key:
        if args.curve_client_keys:
            raise CliError("--curve-client-keys needs --curve-secret-key")
        return AdminPolicy(networks=networks), None, ()
    try:
        curve = security.CurveServerKeys(security.load_keypair(args.curve_secret_key))
        keys = _client_keys(args.curve_client_keys)
    except (OSError, ValueError) as exc:
        raise CliError(f"CURVE keys: {exc}") from None
    # listed keys are admitted and are the admins; with none listed any CURVE client may read and
    # write, and nobody administers
    return AdminPolicy(networks=networks, is_curve=True, admin_keys=frozenset(keys)), curve, keys


def _client_keys(text: str) -> tuple[bytes, ...]:
    from deepinfer.transport import security

    if not text:
        return ()
    path = Path(text)
    if path.is_dir():
        return tuple(security.load_public_key(f) for f in sorted(path.glob("*.key")))
    keys = tuple(k.strip().encode() for k in text.split(",") if k.strip())
    bad = [k for k in keys if len(k) != 40]
    if bad:
        raise ValueError(f"{bad[0].decode()!r} is not a 40-character Z85 public key (nor a directory of .key files)")
    return keys


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


def _status(args) -> int:
    from deepinfer.cache.store.membership import MembershipError, load_membership
    from deepinfer.cache.store.status import cluster_status
    from deepinfer.runtime.loop import run as run_loop

    if not args.cluster:
        raise CliError("status needs --cluster MEMBERSHIP_FILE")
    try:
        membership = load_membership(args.cluster)
        status = run_loop(cluster_status(membership))
    except (MembershipError, ValueError) as exc:
        raise CliError(str(exc)) from None
    print(status.format())
    return 0 if status.num_silent == 0 else 3


def _members(args) -> int:
    from deepinfer.cache.store.membership import (
        Membership,
        MembershipError,
        NodeState,
        load_membership,
        save_membership,
    )

    if not args.cluster:
        raise CliError("members needs --cluster MEMBERSHIP_FILE")
    verb, rest = (args.member_args[0], args.member_args[1:]) if args.member_args else ("", [])
    path = Path(args.cluster)
    try:
        current = load_membership(path) if path.exists() else Membership(0, ())
        if verb == "add" and len(rest) == 2:
            record = current.with_node(rest[0], rest[1])
        elif verb in ("drain", "up", "down", "remove") and len(rest) == 1:
            state = {"drain": NodeState.DRAINING, "up": NodeState.UP, "down": NodeState.DOWN, "remove": NodeState.REMOVED}
            record = current.with_state(rest[0], state[verb])
        else:
            raise CliError("members: give add NAME ADDRESS, or drain|up|down|remove NAME")
    except MembershipError as exc:
        raise CliError(str(exc)) from None
    save_membership(path, record)
    print(f"membership epoch {record.epoch}: " + ", ".join(f"{m.name} {m.state.value}" for m in record.members))
    return 0


def run(args) -> int:
    from deepinfer import envs
    from deepinfer.runtime.loop import run as run_loop

    if args.action == "status":
        return _status(args)
    if args.action == "members":
        return _members(args)
    if args.member_args:
        raise CliError(f"unexpected arguments {' '.join(args.member_args)!r} (serve takes options only)")
    config = _config(args)
    config.dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=envs.get().log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_loop(_serve(config, args.metrics_host, args.metrics_port))
