"""Cluster config: one TOML file describing every node, read with tomllib + msgspec.

    [cluster]
    name = "local"
    heartbeat_interval_s = 0.5     # every node publishes a Heartbeat this often
    missed_beats = 3               # a peer silent for fewer intervals is never suspected
    min_silence_s = 2.0            # ... nor for less than this (the larger floor counts)
    suspect_phi = 8.0              # phi-accrual threshold between the floor and max_silence_s
    max_silence_s = 5.0            # a peer this silent is always suspected
    probe_timeout_s = 1.0          # a suspect is down only if its control channel stays mute this long
    drain_deadline_s = 30          # SIGTERM: in-flight work gets this long to finish

    [security]                     # optional
    curve = true                   # every node then needs curve_public_key
    allow_clients = ["Z85..."]     # extra client keys (operators, tools) admitted by every node

    [storage]                      # the KV store's storage nodes
    ec_k = 10                      # erasure coding: k data + m parity fragments per object
    ec_m = 2
    dir = "/var/lib/deepinfer/storage"   # one subdirectory per storage node
    capacity_bytes = 536870912000
    ttl = "agent=3d,chat=7d"       # TTL classes: retention per traffic class ("default=7d" for the rest)
    membership_file = "/etc/deepinfer/members.json"   # storage membership record: nodes repair (optional)
    admin_from = "10.0.0.0/8"      # networks allowed to send storage admin messages (default: loopback)

    [engine]                       # the prefill/decode engines this file starts (node flags override)
    model = "/models/DeepSeek-V4.1-Flash"   # HF-style model directory (else --model / DEEPINFER_HF_MODEL_DIR)
    max_num_seqs = 8               # 0 (or left out): the engine's default, as for every key below
    num_blocks = 4096
    block_size = 128
    max_model_len = 65536
    dtype = "auto"
    quantization = ""              # "fp8": FP8 weights (serve --quantization)
    speculative = ""               # "dspark": the decode engines draft (serve --speculative); prefill ones never do
    num_draft_tokens = 0           # with speculative: drafts a request may verify per step (0: 5)
    spec_schedule = ""             # with speculative: confidence | throughput | fixed ("": confidence)
    num_threads = 0
    kv_host_tier_bytes = 0
    kv_load_deadline_s = 0.25
    kv_store = true                # engines read prefixes from and write blocks behind to [storage]'s nodes

    [gateway]                      # every gateway node of the file
    routing = "tiered"             # tiered (prefix affinity traded against load) | round-robin | affinity-only
    failure_policy = "recompute"   # a lost engine: recompute elsewhere, or fail the request
    request_timeout_s = 300
    decode_silence_s = 15
    traffic_class = "chat"         # TTL class of requests that name none (body "traffic_class")
    load_noise_s = 0.25            # tiered: backlog differences the load view cannot resolve count as equal

    [[nodes]]
    name = "prefill-0"
    role = "prefill"               # gateway | encoder | prefill | decode | storage
    host = "rack1-07"              # the machine: `deepinfer node --host rack1-07` runs all its nodes (default: name)
    building = "A"                 # the building (data centre) the host stands in
    control = "tcp://10.0.0.5:7100"   # ROUTER: Hello / Drain / Status
    events = "tcp://10.0.0.5:7101"    # PUB: heartbeats, load reports, cache events
    data = "tcp://10.0.0.5:7102"      # bulk data plane receiver (roles that receive bulk data)
    engine = "tcp://10.0.0.5:7103"    # prefill/decode: engine RPC ROUTER (P/D dispatch, handoff, status)
    metrics = "http://10.0.0.5:7104"  # Prometheus GET /metrics of this node (optional)
    http = ""                         # gateway: its OpenAI-compatible HTTP endpoint, http://HOST:PORT
    routing = ""                      # gateway: overrides [gateway] routing for this one
    curve_public_key = "Z85..."
    curve_secret_key_file = "/etc/deepinfer/prefill-0.key_secret"   # read only by that node

Every error names the file and the bad key in one line, e.g.
``cluster.toml: nodes[2].role: expected one of gateway, encoder, prefill, decode, storage, got 'x'``.
"""

from __future__ import annotations

import enum
import re
import tomllib
from pathlib import Path
from typing import Annotated

import msgspec

from deepinfer.runtime.failure_detector import (
    DEFAULT_MAX_SILENCE_S,
    DEFAULT_MIN_SILENCE_S,
    DEFAULT_PROBE_TIMEOUT_S,
    DEFAULT_SUSPECT_PHI,
    DetectorSettings,
    detector_settings,
)
from deepinfer.transport.protocol import Role


class NodeRole(enum.StrEnum):
    GATEWAY = "gateway"
    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"
    STORAGE = "storage"

    @property
    def wire(self) -> Role:
        return Role[self.name]


class ClusterConfigError(ValueError):
    """One line naming the file, the key and what was wrong with it."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class ClusterSection(_Section):
    name: str = "deepinfer"
    heartbeat_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    missed_beats: Annotated[int, msgspec.Meta(ge=1)] = 3
    drain_deadline_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    # failure detection (runtime/failure_detector.py): suspicion floor, phi threshold, cap, probe
    min_silence_s: Annotated[float, msgspec.Meta(gt=0)] = DEFAULT_MIN_SILENCE_S
    suspect_phi: Annotated[float, msgspec.Meta(gt=0)] = DEFAULT_SUSPECT_PHI
    max_silence_s: Annotated[float, msgspec.Meta(gt=0)] = DEFAULT_MAX_SILENCE_S
    probe_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = DEFAULT_PROBE_TIMEOUT_S

    @property
    def down_after_s(self) -> float:
        """The missed-beats floor: silence before which a peer is never suspected."""
        return self.heartbeat_interval_s * self.missed_beats

    @property
    def detector(self) -> DetectorSettings:
        return detector_settings(interval_s=self.heartbeat_interval_s, missed_beats=self.missed_beats,
                                 suspect_phi=self.suspect_phi, min_silence_s=self.min_silence_s,
                                 max_silence_s=self.max_silence_s, probe_timeout_s=self.probe_timeout_s)


class SecuritySection(_Section):
    curve: bool = False
    allow_clients: list[str] = []


class StorageSection(_Section):
    ec_k: Annotated[int, msgspec.Meta(ge=1)] = 10
    ec_m: Annotated[int, msgspec.Meta(ge=0)] = 2
    dir: str = ""  # fragments root, one subdirectory per node ("" = <DEEPINFER_CACHE_DIR>/storage)
    capacity_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0  # per node; 0 = the storage daemon's default
    ttl: str = ""  # per traffic class, e.g. "agent=3d,chat=7d" ("" = the defaults)
    membership_file: str = ""  # storage membership record (cache/store/membership.py): nodes repair
    admin_from: str = ""  # networks allowed to send storage admin messages ("" = loopback only)


ROUTING_POLICIES = ("tiered", "round-robin", "affinity-only")
TRAFFIC_CLASS_PATTERN = r"[a-z][a-z0-9_-]{0,31}"  # the same rule as SamplingParams.traffic_class


class EngineSection(_Section):
    """Engine knobs of the prefill/decode nodes (0 / "" = the engine's default)."""

    model: str = ""
    max_num_seqs: Annotated[int, msgspec.Meta(ge=0)] = 0
    num_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0
    block_size: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_model_len: Annotated[int, msgspec.Meta(ge=0)] = 0
    dtype: str = ""
    quantization: str = ""  # "fp8": the engines serve FP8 weights (serve --quantization); "": none
    speculative: str = ""  # "dspark": decode engines draft (node_role.py turns it off on prefill engines)
    num_draft_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    spec_schedule: str = ""
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    kv_host_tier_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    kv_load_deadline_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    kv_store: bool = True  # engines use [storage]'s nodes when the file lists any

    def options(self) -> dict[str, object]:
        """The EngineOptions fields this section sets."""
        keys = ("max_num_seqs", "num_blocks", "block_size", "max_model_len", "dtype", "quantization", "num_threads",
                "kv_host_tier_bytes", "kv_load_deadline_s", "speculative", "num_draft_tokens", "spec_schedule")
        return {k: getattr(self, k) for k in keys if getattr(self, k)}


class GatewaySection(_Section):
    routing: str = "tiered"
    failure_policy: str = "recompute"
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    decode_silence_s: Annotated[float, msgspec.Meta(gt=0)] = 15.0
    traffic_class: str = "chat"
    load_noise_s: Annotated[float, msgspec.Meta(ge=0)] = 0.25


class NodeSpec(_Section):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    role: NodeRole
    control: str
    events: str
    data: str = ""
    engine: str = ""  # prefill/decode: the engine RPC ROUTER (runtime/disagg)
    curve_public_key: str = ""
    curve_secret_key_file: str = ""
    host: str = ""  # the machine it runs on ("" = a host of its own, named as the node)
    building: str = ""  # the building (data centre) of its host
    metrics: str = ""  # http://HOST:PORT serving GET /metrics ("" = none)
    http: str = ""  # gateway: the OpenAI-compatible endpoint, http://HOST:PORT
    routing: str = ""  # gateway: its routing policy ("" = [gateway] routing)

    @property
    def host_name(self) -> str:
        return self.host or self.name


class ClusterConfig(_Section):
    nodes: Annotated[list[NodeSpec], msgspec.Meta(min_length=1)]
    cluster: ClusterSection = ClusterSection()
    security: SecuritySection = SecuritySection()
    storage: StorageSection = StorageSection()
    engine: EngineSection = EngineSection()
    gateway: GatewaySection = GatewaySection()

    def node(self, name: str) -> NodeSpec:
        for spec in self.nodes:
            if spec.name == name:
                return spec
        raise KeyError(f"no node named {name!r}; the config lists {', '.join(n.name for n in self.nodes)}")

    def nodes_with_role(self, role: NodeRole | str) -> list[NodeSpec]:
        return [spec for spec in self.nodes if spec.role == role]

    def peers_of(self, name: str) -> list[NodeSpec]:
        return [spec for spec in self.nodes if spec.name != name]

    def hosts(self) -> list[str]:
        """Host names in the order the file first names them."""
        return list(dict.fromkeys(spec.host_name for spec in self.nodes))

    def nodes_on_host(self, host: str) -> list[NodeSpec]:
        specs = [spec for spec in self.nodes if spec.host_name == host]
        if not specs:
            raise KeyError(f"no node runs on host {host!r}; the config's hosts are {', '.join(self.hosts())}")
        return specs

    def building_of(self, name: str) -> str:
        return self.node(name).building

    def routing_of(self, gateway: str) -> str:
        return self.node(gateway).routing or self.gateway.routing


_ENUM_KEYS = {"role": NodeRole}
_ADDRESS_RE = re.compile(r"^(tcp://[^:/\s]+:\d+|ipc://\S+)$")
_HTTP_RE = re.compile(r"^http://[^:/\s]+:\d+$")
_MSGSPEC_ERROR_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def load_cluster_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ClusterConfigError(f"{path}: cannot read the cluster config: {exc.strerror}") from None
    return parse_cluster_config(text, source=str(path))


def parse_cluster_config(text: str, source: str = "cluster.toml") -> ClusterConfig:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ClusterConfigError(f"{source}: not valid TOML: {exc}") from None
    try:
        config = msgspec.convert(raw, ClusterConfig)
    except msgspec.ValidationError as exc:
        raise ClusterConfigError(f"{source}: {_describe(str(exc))}") from None
    problem = _check(config)
    if problem:
        raise ClusterConfigError(f"{source}: {problem}")
    return config


def _describe(message: str) -> str:
    """Turn msgspec's 'Expected `int`, got `str` - at `$.nodes[0].x`' into 'nodes[0].x: ...'."""
    match = _MSGSPEC_ERROR_RE.match(message)
    msg, path = match.group("msg"), (match.group("path") or "").lstrip(".")
    if (unknown := re.match(r"Object contains unknown field `(\w+)`", msg)) is not None:
        return f"{_join(path, unknown.group(1))}: unknown key"
    if (missing := re.match(r"Object missing required field `(\w+)`", msg)) is not None:
        return f"{_join(path, missing.group(1))}: required key is missing"
    if msg.startswith("Invalid enum value"):
        enum_type = _ENUM_KEYS.get(path.rsplit(".", 1)[-1])
        if enum_type is not None:
            got = msg.removeprefix("Invalid enum value ").strip()
            return f"{path}: expected one of {', '.join(m.value for m in enum_type)}, got {got}"
    return f"{path or 'top level'}: {msg[:1].lower()}{msg[1:]}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check(config: ClusterConfig) -> str | None:
    """Rules msgspec's types cannot express; the first broken one, as '<key>: <problem>'."""
    if config.cluster.min_silence_s > config.cluster.max_silence_s:
        return (f"cluster.max_silence_s: must be >= min_silence_s ({config.cluster.min_silence_s:g}), "
                f"got {config.cluster.max_silence_s:g}")
    seen_names: dict[str, int] = {}
    seen_addresses: dict[str, str] = {}
    host2building: dict[str, tuple[str, int]] = {}
    for i, spec in enumerate(config.nodes):
        if spec.name in seen_names:
            return f"nodes[{i}].name: duplicate node name {spec.name!r} (also nodes[{seen_names[spec.name]}])"
        seen_names[spec.name] = i
        for key in ("control", "events", "data", "engine"):
            address = getattr(spec, key)
            if not address and key in ("data", "engine"):
                continue
            if not _ADDRESS_RE.match(address):
                return f"nodes[{i}].{key}: expected tcp://HOST:PORT or ipc://PATH, got {address!r}"
            if address in seen_addresses:
                return f"nodes[{i}].{key}: address {address} is already used by {seen_addresses[address]}"
            seen_addresses[address] = f"nodes[{i}].{key}"
        if config.security.curve and len(spec.curve_public_key) != 40:
            return f"nodes[{i}].curve_public_key: a 40-character Z85 key is required when security.curve = true"
        for key in ("metrics", "http"):
            address = getattr(spec, key)
            if address and not _HTTP_RE.match(address):
                return f"nodes[{i}].{key}: expected http://HOST:PORT, got {address!r}"
            if address in seen_addresses:
                return f"nodes[{i}].{key}: address {address} is already used by {seen_addresses[address]}"
            if address:
                seen_addresses[address] = f"nodes[{i}].{key}"
        if spec.http and spec.role != NodeRole.GATEWAY:
            return f"nodes[{i}].http: only a gateway node serves HTTP, this one is {spec.role.value}"
        if spec.routing and spec.role != NodeRole.GATEWAY:
            return f"nodes[{i}].routing: only a gateway node routes, this one is {spec.role.value}"
        if spec.routing and spec.routing not in ROUTING_POLICIES:
            return f"nodes[{i}].routing: expected one of {', '.join(ROUTING_POLICIES)}, got {spec.routing!r}"
        building = host2building.setdefault(spec.host_name, (spec.building, i))
        if building[0] != spec.building:
            return (f"nodes[{i}].building: host {spec.host_name!r} is in building {building[0]!r} "
                    f"(nodes[{building[1]}]), not {spec.building!r}")
    for j, key in enumerate(config.security.allow_clients):
        if len(key) != 40:
            return f"security.allow_clients[{j}]: expected a 40-character Z85 public key"
    problem = _check_sections(config)
    if problem:
        return problem
    num_storage = len(config.nodes_with_role(NodeRole.STORAGE))
    width = config.storage.ec_k + config.storage.ec_m
    if num_storage and num_storage < width:
        return (f"storage: ec_k + ec_m = {width} needs at least {width} storage nodes, the config lists "
                f"{num_storage}; lower ec_k/ec_m or add nodes")
    return None


def _check_sections(config: ClusterConfig) -> str | None:
    """[storage] TTL classes and admin networks, [gateway] policy names, [engine] dtype."""
    from deepinfer.cache.store.admin_policy import parse_networks
    from deepinfer.cache.store.gc import parse_ttl_spec

    try:
        ttl = parse_ttl_spec(config.storage.ttl)
    except ValueError as exc:
        return f"storage.ttl: {exc}"
    try:
        parse_networks(config.storage.admin_from)
    except ValueError as exc:
        return f"storage.admin_from: {exc}"
    gateway = config.gateway
    if gateway.routing not in ROUTING_POLICIES:
        return f"gateway.routing: expected one of {', '.join(ROUTING_POLICIES)}, got {gateway.routing!r}"
    if gateway.failure_policy not in ("recompute", "fail"):
        return f"gateway.failure_policy: expected recompute or fail, got {gateway.failure_policy!r}"
    if not re.fullmatch(TRAFFIC_CLASS_PATTERN, gateway.traffic_class):
        return f"gateway.traffic_class: expected a class name like chat or agent, got {gateway.traffic_class!r}"
    if config.storage.ttl and gateway.traffic_class not in ttl.class2ttl_s:
        return (f"gateway.traffic_class: {gateway.traffic_class!r} is not a TTL class of storage.ttl "
                f"({', '.join(ttl.class2ttl_s)}); its blocks would get the default TTL")
    if config.engine.dtype not in ("", "auto", "float32", "bfloat16", "float16"):
        return f"engine.dtype: expected auto, float32, bfloat16 or float16, got {config.engine.dtype!r}"
    if config.engine.quantization not in ("", "fp8"):
        return f"engine.quantization: expected fp8 or nothing, got {config.engine.quantization!r}"
    if config.engine.speculative not in ("", "off", "dspark"):
        return f"engine.speculative: expected dspark, off or nothing, got {config.engine.speculative!r}"
    if config.engine.spec_schedule not in ("", "confidence", "throughput", "fixed"):
        return (f"engine.spec_schedule: expected confidence, throughput, fixed or nothing, "
                f"got {config.engine.spec_schedule!r}")
    return None
