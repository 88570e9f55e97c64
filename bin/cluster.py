"""`deepinfer cluster`: the whole cluster of a cluster file, seen from here.

    deepinfer cluster status cluster.toml      every node's health, load and cache figures

Exit status 0 when every node answered, 3 when some did not (they are listed as down).
"""

from __future__ import annotations

from deepinfer.bin.cli import CliError


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name,
        help="inspect a running cluster from its cluster file",
        description="Ask every node of a cluster file for its health, load and cache figures: control channels, "
                    "engine RPCs, storage nodes and gateways' /metrics. Nodes that do not answer in time are "
                    "reported down.",
    )
    p.add_argument("action", choices=["status"], help="status: one line per node")
    p.add_argument("cluster", help="cluster config TOML file")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds each node has to answer (default 2)")
    return p


def run(args) -> int:
    from deepinfer.runtime.cluster_config import ClusterConfigError, load_cluster_config
    from deepinfer.runtime.cluster_status import cluster_report
    from deepinfer.runtime.loop import run as run_loop

    if not 0 < args.timeout <= 60:
        raise CliError(f"--timeout must be in (0, 60] seconds, got {args.timeout}", code=2)
    try:
        config = load_cluster_config(args.cluster)
    except ClusterConfigError as exc:
        raise CliError(str(exc)) from None
    report = run_loop(cluster_report(config, args.timeout))
    print(report.format())
    return 0 if report.num_down == 0 else 3
