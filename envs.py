"""Every environment variable DeepInfer reads, in one typed place (prefix ``DEEPINFER_``).

Code never calls ``os.environ`` itself; it reads ``deepinfer.envs.get()`` (a frozen snapshot
taken at first use) so tests can build a fresh snapshot with ``load(environ)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "deepinfer")


@dataclass(frozen=True, slots=True)
class Envs:
    # Model directory used when no --model/model= is given (name kept from DeepSeek's release).
    hf_model_dir: str = ""
    # Where the built-in tiny model and other generated artefacts are cached.
    cache_dir: str = ""
    # What `deepinfer serve` loads with no --model: "trained" (the tiny DeepSeek-V4.1 checkpoint
    # trained on the Python standard library, shipped in the package) or "random" (the random
    # tiny V4 model written once under cache_dir; the server tests use it).
    builtin_model: str = "trained"
    # "nvidia" | "cpu" | "" (auto): which accelerator the kernels dispatch for.
    accelerator: str = ""
    # Log level for every daemon: DEBUG, INFO, WARNING, ERROR.
    log_level: str = "INFO"
    # Set to 0 to keep the standard asyncio loop instead of uvloop.
    use_uvloop: bool = True
    # Largest single ZeroMQ control frame accepted, in bytes (bulk data has its own limit).
    max_control_frame_bytes: int = 16 * 1024 * 1024
    # Largest bulk transfer accepted by a data-plane receiver, in bytes.
    max_bulk_bytes: int = 8 * 1024 * 1024 * 1024
    # Host-memory KV tier of each engine, in bytes (0: none), unless --kv-host-tier-bytes is given.
    kv_host_tier_bytes: int = 0
    # Seconds a prefix-block read from the KV store may take before the rest is recomputed.
    kv_load_deadline_s: float = 0.25
    # The erasure-coded KV storage cluster, unless --kv-store-nodes is given: storage node
    # addresses (tcp://HOST:PORT,...) or a cluster config file ("" = none).
    kv_store_nodes: str = ""
    # K+M erasure coding of a KV store address list, unless --kv-store-ec is given ("" = 10+2).
    kv_store_ec: str = ""
    # Set by a supervising parent (runtime/lifeline.py) for its children, not by users: the
    # parent's pid, the read end of its lifeline pipe, and a directory to remove if it dies.
    parent_pid: int = 0
    parent_lifeline_fd: int = -1
    parent_cleanup_dir: str = ""
    # How many random tiny configs tests/engine/test_v4_parity_random.py checks against
    # transformers (CI runs the default; raise it locally for a longer search).
    parity_configs: int = 20
    # DeepSeek-V4.1's numerics: "float" (weights dequantised exactly, nothing rounded; the CPU
    # parity path) or "official" (FP8 activation rounding and the released FP8/FP4 KV grids).
    v41_numerics: str = "float"
    # Set to 0 to run every forward eagerly on a CUDA device (no CUDA graphs of decode steps).
    cuda_graphs: bool = True
    # Forwards of up to this many tokens are CUDA-graphed (decode steps, small prefill chunks);
    # larger ones run eagerly. Raise it to graph a repeated prompt length (a graph holds its
    # activations' memory in the graphs' pool).
    cuda_graph_max_tokens: int = 512
    # Set to 0 to read each decode step's sampled ids on the host before the next decode forward
    # is launched (accelerators only; by default that forward takes them from the device).
    feed_ids: bool = True
    # Comma-separated op names (kernels/ops.py) whose Triton kernels stay off on CUDA: those ops
    # keep the torch routing there (e.g. "compress_pool,linear" to bisect a kernel on a device).
    triton_off: str = ""


_ENV_NAMES = {
    "hf_model_dir": "DEEPINFER_HF_MODEL_DIR",
    "v41_numerics": "DEEPINFER_V41_NUMERICS",
    "cuda_graphs": "DEEPINFER_CUDA_GRAPHS",
    "cuda_graph_max_tokens": "DEEPINFER_CUDA_GRAPH_MAX_TOKENS",
    "feed_ids": "DEEPINFER_FEED_IDS",
    "triton_off": "DEEPINFER_TRITON_OFF",
    "cache_dir": "DEEPINFER_CACHE_DIR",
    "builtin_model": "DEEPINFER_BUILTIN_MODEL",
    "accelerator": "DEEPINFER_ACCELERATOR",
    "log_level": "DEEPINFER_LOG_LEVEL",
    "use_uvloop": "DEEPINFER_USE_UVLOOP",
    "max_control_frame_bytes": "DEEPINFER_MAX_CONTROL_FRAME_BYTES",
    "max_bulk_bytes": "DEEPINFER_MAX_BULK_BYTES",
    "kv_host_tier_bytes": "DEEPINFER_KV_HOST_TIER_BYTES",
    "kv_load_deadline_s": "DEEPINFER_KV_LOAD_DEADLINE_S",
    "kv_store_nodes": "DEEPINFER_KV_STORE_NODES",
    "kv_store_ec": "DEEPINFER_KV_STORE_EC",
    "parity_configs": "DEEPINFER_PARITY_CONFIGS",
    "parent_pid": "DEEPINFER_PARENT_PID",
    "parent_lifeline_fd": "DEEPINFER_PARENT_LIFELINE_FD",
    "parent_cleanup_dir": "DEEPINFER_PARENT_CLEANUP_DIR",
}


def _parse(name: str, raw: str, default):
    if isinstance(default, bool):
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean; use 1 or 0")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer") from None
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number") from None
    return raw


def load(environ: dict[str, str] | None = None) -> Envs:
    """Build a snapshot from ``environ`` (default: the process environment)."""
    env = os.environ if environ is None else environ
    values = {}
    for f in fields(Envs):
        name = _ENV_NAMES[f.name]
        if name in env:
            values[f.name] = _parse(name, env[name], f.default)
    snap = Envs(**values)
    if not snap.cache_dir:
        snap = Envs(**{**{f.name: getattr(snap, f.name) for f in fields(Envs)}, "cache_dir": _default_cache_dir()})
    return snap


_snapshot: Envs | None = None


def get() -> Envs:
    global _snapshot
    if _snapshot is None:
        _snapshot = load()
    return _snapshot


def names() -> dict[str, str]:
    """Field name -> environment variable name, for --help texts and docs."""
    return dict(_ENV_NAMES)
