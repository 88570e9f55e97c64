"""A cluster config for gateway + N prefill + M decode engines (+ K vision encoders) on this machine (loopback).

``ipc`` (default) puts every socket under one short private directory; ``tcp`` uses free
127.0.0.1 ports (the cross-host code path, on one host). The same engines and gateway run on
either: only the addresses differ. Failure detection (heartbeat interval, suspicion floor, phi
threshold, cap, probe timeout) goes into ``[cluster]`` so the gateway and every engine judge
peers alike; the floor is given in seconds (``missed_beats = 1``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from deepinfer.runtime.cluster_config import ClusterConfig, parse_cluster_config
from deepinfer.runtime.failure_detector import DetectorSettings
from deepinfer.transport.ports import free_tcp_port

# engines on one host: beats every 0.2 s, the detector's default thresholds
LOCAL_DETECTOR = DetectorSettings(interval_s=0.2)


def local_cluster_toml(num_prefill: int, num_decode: int, *, root: str | Path, transport: str = "ipc",
                       detector: DetectorSettings = LOCAL_DETECTOR, num_encoders: int = 0) -> str:
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"a disaggregated cluster needs >= 1 prefill and >= 1 decode engine, got {num_prefill}, {num_decode}")
    if transport not in ("ipc", "tcp"):
        raise ValueError(f"transport must be ipc or tcp, got {transport!r}")

    def address(node: str, kind: str) -> str:
        if transport == "tcp":
            return f"tcp://127.0.0.1:{free_tcp_port()}"
        return f"ipc://{Path(root) / f'{node}.{kind}'}"

    lines = ["[cluster]", 'name = "local-pd"', f"heartbeat_interval_s = {detector.interval_s!r}", "missed_beats = 1",
             f"min_silence_s = {detector.min_silence_s!r}", f"suspect_phi = {detector.suspect_phi!r}",
             f"max_silence_s = {detector.max_silence_s!r}", f"probe_timeout_s = {detector.probe_timeout_s!r}",
             "drain_deadline_s = 5", ""]
    nodes = [("gateway-0", "gateway")] + [(f"prefill-{i}", "prefill") for i in range(num_prefill)] + \
            [(f"decode-{j}", "decode") for j in range(num_decode)] + \
            [(f"encoder-{k}", "encoder") for k in range(num_encoders)]  # encode RPC on their engine address
    for name, role in nodes:
        lines += ["[[nodes]]", f'name = "{name}"', f'role = "{role}"', f'control = "{address(name, "control")}"',
                  f'events = "{address(name, "events")}"', f'data = "{address(name, "data")}"']
        if role != "gateway":
            lines.append(f'engine = "{address(name, "engine")}"')
        lines.append("")
    return "\n".join(lines)


def write_local_cluster(num_prefill: int, num_decode: int, *, transport: str = "ipc", root: str | Path | None = None,
                        detector: DetectorSettings = LOCAL_DETECTOR, num_encoders: int = 0) -> tuple[Path, ClusterConfig]:
    """Write ``cluster.toml`` into ``root`` (default: a new short temp dir; ipc paths must stay
    under ~100 characters) and return its path and parsed config."""
    root = Path(root or tempfile.mkdtemp(prefix="di-pd-"))
    text = local_cluster_toml(num_prefill, num_decode, root=root, transport=transport, detector=detector,
                              num_encoders=num_encoders)
    path = root / "cluster.toml"
    path.write_text(text)
    return path, parse_cluster_config(text, source=str(path))
