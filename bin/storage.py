"""`deepinfer storage`: one storage node of the erasure-coded KV cache cluster."""

from __future__ import annotations

from deepinfer.bin.cli import NotBuiltError


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name,
        help="run a storage node of the KV cache cluster",
        description="Run one storage node: erasure-coded fragments on local disk, LRU GC, TTL per traffic class.",
    )
    p.add_argument("--dir", required=True, help="directory holding this node's fragments and index")
    p.add_argument("--listen", default="tcp://127.0.0.1:7600", help="ZeroMQ address to listen on")
    p.add_argument("--capacity", default="10GiB", help="bytes this node may hold, e.g. 500GiB")
    return p


def run(args) -> int:
    raise NotBuiltError("the storage node daemon ([kv-store])")
