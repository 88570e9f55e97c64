"""`deepinfer node`: one long-lived daemon of a cluster, in one role."""

from __future__ import annotations

from deepinfer.bin.cli import NotBuiltError


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name,
        help="run one cluster node daemon in a role",
        description="Run one node daemon (gateway, encoder, prefill, decode or storage) from a cluster config.",
    )
    p.add_argument("--role", required=True, choices=["gateway", "encoder", "prefill", "decode", "storage"])
    p.add_argument("--cluster", required=True, help="cluster config TOML file")
    p.add_argument("--name", default=None, help="this node's name in the cluster config")
    return p


def run(args) -> int:
    raise NotBuiltError(f"the {args.role} role of the node daemon")
