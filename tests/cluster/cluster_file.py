"""The cluster TOML an operator would write for a NetnsCluster: every host's node at its own
namespace address (runtime/cluster_config.py's format), and the command that starts one host's
node from it.

Each host has its own network stack, so every node uses the same ports: control 7100, events
7101, data 7102, engine 7103, on its host's address.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

CONTROL_PORT, EVENTS_PORT, DATA_PORT, ENGINE_PORT = 7100, 7101, 7102, 7103


def write_cluster_file(path: Path, cluster, host2role: Mapping[str, str], *, storage: Mapping[str, object] = {},
                       settings: Mapping[str, object] = {}) -> Path:
    """Write ``path`` naming one node per host of ``host2role`` (host -> gateway|prefill|decode|
    storage), ``[storage]`` keys from ``storage`` and ``[cluster]`` keys from ``settings``."""
    lines = ["[cluster]", f'name = "netns-{cluster.run_id}"', *(_kv(k, v) for k, v in settings.items()), ""]
    if storage:
        lines += ["[storage]", *(_kv(k, v) for k, v in storage.items()), ""]
    for host, role in host2role.items():
        addr = cluster.address(host)
        lines += ["[[nodes]]", f'name = "{host}"', f'role = "{role}"',
                  f'control = "tcp://{addr}:{CONTROL_PORT}"', f'events = "tcp://{addr}:{EVENTS_PORT}"']
        if role in ("storage", "prefill", "decode"):
            lines.append(f'data = "tcp://{addr}:{DATA_PORT}"')
        if role in ("prefill", "decode"):
            lines.append(f'engine = "tcp://{addr}:{ENGINE_PORT}"')
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def node_command(cluster, path: Path, host: str, role: str, *extra: str) -> list[str]:
    """``deepinfer node --role ROLE --cluster FILE --name HOST``: what an operator runs on that host."""
    return cluster.deepinfer("node", "--role", role, "--cluster", str(path), "--name", host, *extra)


def _kv(key: str, value: object) -> str:
    if isinstance(value, bool):
        return f"{key} = {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"{key} = {value}"
    return f'{key} = "{value}"'
