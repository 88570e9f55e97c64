"""The disaggregated cluster the P/D netns tests run, as an operator would write it: one cluster
file naming every host, its building and its nodes, started with one
``deepinfer node --cluster FILE --host NAME`` per host.

    building A: gw (3 gateways: tiered, round-robin, affinity-only), p0, p1 (prefill), d0 (decode),
                s0, s1 (2 storage daemons each)
    building B: d1 (decode), s2 (2 storage daemons)

Storage: 6 daemons, EC k=4 m=2. Ports are per host (each host has its own network stack), counted
up from 7100 for the nodes sharing a host. Helpers to talk HTTP to gateways and read /metrics.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

HOSTS = {"gw": "A", "p0": "A", "p1": "A", "d0": "A", "s0": "A", "s1": "A", "d1": "B", "s2": "B"}
GATEWAYS = {"gw": "tiered", "gw-rr": "round-robin", "gw-aff": "affinity-only"}  # all on host gw
STORAGE = {"s0": ["s0a", "s0b"], "s1": ["s1a", "s1b"], "s2": ["s2a", "s2b"]}
EC_K, EC_M = 4, 2
BLOCK_SIZE = 16
HTTP_PORT = 8000
MODEL_NAME = "tiny"


def node_plan() -> list[tuple[str, str, str, dict]]:
    """(node name, role, host, extra keys) in file order."""
    plan = [(name, "gateway", "gw", {"routing": policy}) for name, policy in GATEWAYS.items()]
    plan += [("p0", "prefill", "p0", {}), ("p1", "prefill", "p1", {}), ("d0", "decode", "d0", {}),
             ("d1", "decode", "d1", {})]
    plan += [(daemon, "storage", host, {}) for host, daemons in STORAGE.items() for daemon in daemons]
    return plan


def write_cluster_file(path: Path, address_of: Callable[[str], str], *, model_dir: Path, storage_dir: Path,
                       settings: Mapping[str, object] = {}) -> Path:
    """``address_of(host)``: the host's IP address."""
    lines = ["[cluster]", 'name = "netns-pd"', "heartbeat_interval_s = 0.3", "missed_beats = 3",
             "min_silence_s = 1.5", "max_silence_s = 3.0", "probe_timeout_s = 1.0", "drain_deadline_s = 5",
             *(f"{k} = {json.dumps(v)}" for k, v in settings.items()), "",
             "[storage]", f"ec_k = {EC_K}", f"ec_m = {EC_M}", f'dir = "{storage_dir}"',
             f"capacity_bytes = {256 * 1024**2}", 'ttl = "agent=3d,chat=7d"', "",
             "[engine]", f'model = "{model_dir}"', f"block_size = {BLOCK_SIZE}", "num_blocks = 512",
             "max_model_len = 2048", 'dtype = "float32"', "num_threads = 1", "max_num_seqs = 8",
             "kv_load_deadline_s = 3.0", "",
             "[gateway]", "request_timeout_s = 60", "decode_silence_s = 8", 'traffic_class = "chat"', ""]
    next_port: dict[str, int] = {}
    http_port: dict[str, int] = {}
    for name, role, host, extra in node_plan():
        addr = address_of(host)
        base = next_port.get(host, 7100)
        next_port[host] = base + 10
        lines += ["[[nodes]]", f'name = "{name}"', f'role = "{role}"', f'host = "{host}"',
                  f'building = "{HOSTS[host]}"', f'control = "tcp://{addr}:{base}"', f'events = "tcp://{addr}:{base + 1}"',
                  f'data = "tcp://{addr}:{base + 2}"', f'metrics = "http://{addr}:{base + 4}"']
        if role in ("prefill", "decode"):
            lines.append(f'engine = "tcp://{addr}:{base + 3}"')
        if role == "gateway":
            port = http_port[host] = http_port.get(host, HTTP_PORT - 1) + 1
            lines.append(f'http = "http://{addr}:{port}"')
        lines += [f'{k} = "{v}"' for k, v in extra.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


# ---- talking to the cluster --------------------------------------------------------------------
def http_json(address: str, port: int, method: str, path: str, body: dict | None = None,
              timeout_s: float = 60.0) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(address, port, timeout=timeout_s)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw) if raw else {}
    except ValueError:
        return resp.status, {"raw": raw.decode(errors="replace")}


def chat(address: str, port: int, messages: list[dict], *, max_tokens: int = 8, traffic_class: str | None = None,
         timeout_s: float = 60.0) -> tuple[int, dict]:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    if traffic_class is not None:
        body["traffic_class"] = traffic_class
    return http_json(address, port, "POST", "/v1/chat/completions", body, timeout_s)


def scrape(address: str, port: int, timeout_s: float = 10.0) -> dict[tuple[str, tuple], float]:
    """GET /metrics as {(sample name, sorted label items): value}."""
    conn = http.client.HTTPConnection(address, port, timeout=timeout_s)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(samples: Mapping, name: str, **labels) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, items), v in samples.items() if n == name and want <= set(items))


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.3) -> float:
    start = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)
