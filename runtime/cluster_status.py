"""``deepinfer cluster status FILE``: every node of a running cluster, asked directly.

    node   host  building  role     state  uptime  load                 cache
    gw     gw    A         gateway  up     52s     routed 140           hit 61.2% (device 40.3%, store 20.9%), store 812 blocks
    p0     p0    A         prefill  up     55s     0 req                 612/1024 blocks, hit 58.1%; store 97 reads, 96 hit
    d1     d1    B         decode   down   -       -                    -
    s0a    s0    B         storage  up     58s     12 gets/s            2041 fragments, 18.2 MiB/1.0 GiB

Each node's control channel says whether it is up (and draining); engines answer a
``PdStatusRequest`` on their engine RPC (load, prefix cache and KV tier counters), storage nodes a
``StorageStatsRequest`` on their data address, gateways their ``/metrics`` over HTTP (routing
counters). A node that does not answer within ``timeout_s`` is ``down``: the command reports what
it can reach (a cut link shows as the far building's nodes down), it never hangs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from deepinfer.runtime.cluster_config import ClusterConfig, NodeRole, NodeSpec
from deepinfer.transport.channels import RequestClient
from deepinfer.transport.errors import TransportError
from deepinfer.transport.protocol import (
    NodeControlReply,
    NodeStatus,
    PdEngineReply,
    PdEngineStatus,
    PdStatusRequest,
    StatusRequest,
    StorageStats,
)


@dataclass(slots=True)
class NodeReport:
    spec: NodeSpec
    status: NodeStatus | None = None  # None: its control channel did not answer
    engine: PdEngineStatus | None = None
    storage: StorageStats | None = None
    gateway: dict[str, float] = field(default_factory=dict)  # metric name -> value (summed over labels)

    @property
    def state(self) -> str:
        if self.status is None:
            return "down"
        return "draining" if self.status.is_draining else "up"


@dataclass(slots=True)
class ClusterReport:
    nodes: list[NodeReport]

    @property
    def num_down(self) -> int:
        return sum(r.status is None for r in self.nodes)

    def format(self) -> str:
        rows = [("node", "host", "building", "role", "state", "uptime", "load", "cache")]
        for r in self.nodes:
            s = r.spec
            uptime = f"{r.status.uptime_s:.0f}s" if r.status is not None else "-"
            rows.append((s.name, s.host_name, s.building or "-", s.role.value, r.state, uptime, _load(r), _cache(r)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        by_role: dict[str, list[int]] = {}
        for r in self.nodes:
            counts = by_role.setdefault(r.spec.role.value, [0, 0])
            counts[0] += r.status is not None
            counts[1] += 1
        lines.append("up: " + ", ".join(f"{role} {up}/{n}" for role, (up, n) in by_role.items()))
        return "\n".join(lines)


def _load(r: NodeReport) -> str:
    if r.engine is not None:
        return f"{r.engine.num_requests} req, {r.engine.num_handoffs} handoffs"
    if r.storage is not None:
        return f"{r.storage.num_gets} gets, {r.storage.num_puts} puts"
    if r.gateway:
        return f"routed {r.gateway.get('deepinfer_router_routed_total', 0):.0f}"
    return "-"


def _cache(r: NodeReport) -> str:
    if r.engine is not None:
        kv = r.engine.kv
        text = f"{kv.get('num_cached_blocks', 0)}/{kv.get('num_blocks', 0)} blocks"
        if kv.get("num_queried_blocks"):
            text += f", hit {kv['num_hit_blocks'] / kv['num_queried_blocks']:.1%}"
        if "num_store_reads" in kv:
            text += (f"; store {kv['num_store_reads']} reads, {kv['num_loaded_store']} blocks loaded, "
                     f"{kv['num_written_store']} written")
        return text
    if r.storage is not None:
        return f"{r.storage.num_fragments} fragments, {_size(r.storage.used_bytes)}/{_size(r.storage.capacity_bytes)}"
    if r.gateway:
        g = r.gateway
        prompt = g.get("deepinfer_router_prompt_tokens_total", 0)
        if not prompt:
            return "no prompts yet"
        by_tier = ", ".join(f"{tier} {g.get(f'by_tier:{tier}', 0) / prompt:.1%}" for tier in ("device", "host", "store"))
        return (f"hit {g.get('deepinfer_router_cached_tokens_total', 0) / prompt:.1%} ({by_tier}), "
                f"store {g.get('deepinfer_router_store_blocks', 0):.0f} blocks")
    return "-"


async def cluster_report(config: ClusterConfig, timeout_s: float = 2.0) -> ClusterReport:
    reports = [NodeReport(spec) for spec in config.nodes]
    storage_task = asyncio.ensure_future(_storage_stats(config, timeout_s))
    await asyncio.gather(*(_ask(r, timeout_s) for r in reports))
    name2stats = await storage_task
    for r in reports:
        r.storage = name2stats.get(r.spec.name)
    return ClusterReport(reports)


async def _ask(report: NodeReport, timeout_s: float) -> None:
    spec = report.spec
    report.status = await _request(spec.control, NodeControlReply, StatusRequest(), timeout_s, NodeStatus)
    if report.status is None:
        return
    if spec.role in (NodeRole.PREFILL, NodeRole.DECODE) and spec.engine:
        report.engine = await _request(spec.engine, PdEngineReply, PdStatusRequest(), timeout_s, PdEngineStatus)
    elif spec.role == NodeRole.GATEWAY and spec.http:
        report.gateway = await asyncio.get_running_loop().run_in_executor(None, _scrape, spec.http, timeout_s)


async def _request(address: str, union, msg, timeout_s: float, expected: type):
    client = RequestClient(address, union, name="cluster-status")
    await client.start()
    try:
        reply = await client.request(msg, timeout_s=timeout_s)
    except TransportError:
        return None
    finally:
        await client.close()
    return reply if isinstance(reply, expected) else None


async def _storage_stats(config: ClusterConfig, timeout_s: float) -> dict[str, StorageStats | None]:
    if not config.nodes_with_role(NodeRole.STORAGE):
        return {}
    from deepinfer.cache.store.client import ClusterStore

    async with ClusterStore.from_cluster_config(config, probe_nodes=False) as store:
        return await store.node_stats(timeout_s)


def _scrape(http: str, timeout_s: float) -> dict[str, float]:
    """A gateway's /metrics, as sample name -> value summed over labels ('by_tier:TIER' per tier)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{http}/metrics", timeout=timeout_s) as response:
            text = response.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "deepinfer_router_cached_tokens_by_tier_total":
                key = f"by_tier:{sample.labels.get('tier')}"
            else:
                key = sample.name
            out[key] = out.get(key, 0.0) + sample.value
    return out


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes} B"
