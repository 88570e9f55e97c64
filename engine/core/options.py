"""Build an ``EngineCore`` (runner, tokenizer, structured-output backend) from a model directory.

``EngineOptions`` holds every engine knob with its default; ``build_engine(model_dir, options)``
loads the checkpoint, sizes the KV block pool and wires the core. It blocks (weights are read
from disk), so AsyncEngine calls it in an executor.

KV pool size: ``num_blocks`` when given; else ``kv_cache_memory_bytes / bytes_per_block`` when a
budget is given; else room for ``max_num_seqs`` sequences of ``max_model_len`` tokens each (the
pool never preempts then). ``max_model_len`` defaults to the model's context length.

SWA slots: ``swa_replay`` sets how a prefix hit's sliding-window state is replayed; a host slot
store (``swa_store_slots``) saves finished sequences' states so a continuation restores them
(engine/kv/swa_slots.py). With ``swa_directory`` the engine also shares slots with other engines;
the sockets for that start on the serving loop (AsyncEngine, cache/swa_peer.py). KV tiers
(``kv_host_tier_bytes``, ``kv_store_dir`` or the storage cluster ``kv_store_nodes``) extend the prefix
cache past the device pool.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from deepinfer import envs
from deepinfer.cache.block_cache import BlockCache
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.models.registry import FamilyConfig, family, read_model_config
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.sched.scheduler import SchedulerConfig
from deepinfer.engine.kv.offload import KVOffload, KVOffloadConfig
from deepinfer.engine.sample.structured_output import StructuredOutputBackend
from deepinfer.engine.kv.swa_replay import SWA_REPLAY_MODES
from deepinfer.engine.kv.swa_slots import SwaSlotManager, attach_swa_slots
from deepinfer.engine.text.tokenizer import Tokenizer
from deepinfer.engine.loader.weights import resolve_dtype

log = logging.getLogger(__name__)

class EngineOptionsError(ValueError):
    """A bad engine option; the message names it."""


@dataclass(frozen=True, slots=True)
class EngineOptions:
    dtype: str = "auto"  # "float32" | "bfloat16" | "float16" | "auto" (float32 on CPU, checkpoint dtype on GPU)
    device: str = "auto"  # "cpu" | "cuda" | "cuda:N" | "auto"
    max_num_seqs: int = 8  # concurrent sequences (= SWA slots)
    max_num_batched_tokens: int = 32768  # token budget per step
    max_model_len: int | None = None  # prompt + output tokens; default: the model's context length
    num_blocks: int | None = None  # KV blocks; overrides kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # KV pool budget in bytes
    block_size: int = 128
    lookahead: int = 6  # positions a speculative step may roll back
    enable_prefix_caching: bool = True
    batch_invariant: bool | None = None  # None: on for CPU float32
    seed: int = 0  # source of seeds for requests that give none
    skip_tokenizer_init: bool = False
    served_model_name: str | None = None
    max_num_waiting: int | None = None  # queue capacity; beyond it generate raises EngineOverloadedError
    step_time_target_s: float | None = None  # chunk sizing by the cost model (None: token budget only)
    num_threads: int | None = None  # torch intra-op threads (CPU)
    # JSON schemas allow any whitespace between tokens (xgrammar's default); False: compact JSON,
    # which keeps small or weak models from wandering off into whitespace
    json_any_whitespace: bool = True
    # CPython GIL switch interval set at start (process-wide): the device thread holds the GIL
    # between torch ops; a short interval lets the loop thread in promptly. None: leave it.
    switch_interval_s: float | None = 0.0005
    check_integrity_every_step: bool = False  # debug: EngineCore.check_integrity() after each step
    # SWA slots (engine/kv/swa_slots.py, SPEC section 3). A prefix hit whose sliding-window state
    # is not in a slot is rebuilt by replay: "exact" replays sliding_window x layers tokens (the
    # state equals a full prefill's), "bounded" only the last swa_replay_tokens (constant cost,
    # approximate; such sequences never enter the prefix cache or the slot store)
    swa_replay: str = "exact"
    swa_replay_tokens: int = 128
    # host slot store: a finished or preempted sequence's state at its last block boundary, so a
    # continued conversation restores it instead of replaying (window rows in MXFP8, as in
    # DeepSeek's system: a restored state is approximate, so outputs after a restore may differ
    # from a cold run). Slots; 0 (default): no store, every rebuild exact; None: 4 x max_num_seqs
    swa_store_slots: int | None = 0
    # end each prompt's last chunk at its last block boundary, so its slot is saved even when
    # decoding never crosses one (one more step for the prompt's tail; P/D prefill engines: on)
    swa_snapshot_prompts: bool = False
    swa_fetch_deadline_s: float = 0.1  # a slot fetch from another engine not done by then: replay
    # the SWA directory (tcp://HOST:PORT or ipc://PATH): this engine tells it which slots it holds
    # and serves them to other engines, and fetches theirs before queueing a request
    swa_directory: str | None = None
    swa_node_name: str | None = None  # this engine in the directory (default: host-pid)
    swa_peer_host: str = "127.0.0.1"  # interface other engines reach this one's slot sockets on
    # KV tiers (engine/kv/offload.py): prefix blocks kept in host memory / a store directory past
    # the device pool. None: DEEPINFER_KV_HOST_TIER_BYTES (0 = none) / DEEPINFER_KV_LOAD_DEADLINE_S
    kv_host_tier_bytes: int | None = None
    kv_store_dir: str | None = None  # a filesystem KV store shared by the engines of this host
    # the erasure-coded storage cluster (engine/kv_store_cluster.py): storage node addresses
    # ("tcp://H:P,tcp://H:P,..." or a list) or a cluster config file with storage nodes; None:
    # DEEPINFER_KV_STORE_NODES ("" = none). Not with kv_store_dir. kv_store_ec: "K+M" of an
    # address list (None: DEEPINFER_KV_STORE_EC, else 10+2); a config file carries its own
    kv_store_nodes: str | tuple[str, ...] | list[str] | None = None
    kv_store_ec: str | None = None
    kv_load_deadline_s: float | None = None

    def __post_init__(self) -> None:
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise EngineOptionsError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("max_model_len", "num_blocks", "kv_cache_memory_bytes", "max_num_waiting", "num_threads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise EngineOptionsError(f"{name} must be an integer >= 1 or None, got {v!r}")
        if self.device != "auto" and self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise EngineOptionsError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        self._check_swa()
        self._check_kv_tiers()

    def _check_swa(self) -> None:
        _require(self.swa_replay in SWA_REPLAY_MODES,
                 f"swa_replay must be 'exact' or 'bounded', got {self.swa_replay!r}")
        _require(_is_int(self.swa_replay_tokens) and self.swa_replay_tokens >= 1,
                 f"swa_replay_tokens must be an integer >= 1, got {self.swa_replay_tokens!r}")
        slots = self.swa_store_slots
        _require(slots is None or (_is_int(slots) and slots >= 0),
                 f"swa_store_slots must be an integer >= 0 or None, got {slots!r}")
        _require(isinstance(self.swa_snapshot_prompts, bool),
                 f"swa_snapshot_prompts must be True or False, got {self.swa_snapshot_prompts!r}")
        _require(_is_seconds(self.swa_fetch_deadline_s),
                 f"swa_fetch_deadline_s must be a number of seconds > 0, got {self.swa_fetch_deadline_s!r}")
        if self.swa_directory is not None:
            _require(isinstance(self.swa_directory, str) and self.swa_directory.startswith(("tcp://", "ipc://")),
                     f"swa_directory must be tcp://HOST:PORT or ipc://PATH, got {self.swa_directory!r}")
            _require(slots != 0, "swa_directory needs a slot store (swa_store_slots > 0): slots are served from it "
                                 "and fetched into it")
        name = self.swa_node_name
        _require(name is None or (isinstance(name, str) and bool(name.strip())),
                 f"swa_node_name must be a non-blank string, got {name!r}")
        host = self.swa_peer_host
        _require(isinstance(host, str) and bool(host.strip()) and "/" not in host,
                 f"swa_peer_host must be a host name or IP address, got {host!r}")

    def _check_kv_tiers(self) -> None:
        num_bytes = self.kv_host_tier_bytes
        _require(num_bytes is None or (_is_int(num_bytes) and num_bytes >= 0),
                 f"kv_host_tier_bytes must be an integer >= 0 or None, got {num_bytes!r}")
        _require(self.kv_load_deadline_s is None or _is_seconds(self.kv_load_deadline_s),
                 f"kv_load_deadline_s must be a number of seconds > 0, got {self.kv_load_deadline_s!r}")
        path = self.kv_store_dir
        _require(path is None or (isinstance(path, str) and bool(path.strip())),
                 f"kv_store_dir must be a directory path, got {path!r}")
        if self.kv_store_nodes is not None:
            _require(path is None, "give kv_store_dir (a filesystem store) or kv_store_nodes (a storage cluster), "
                                   "not both")
            _store_cluster(self.kv_store_nodes, self.kv_store_ec)  # raises for a bad value, before any load
        elif self.kv_store_ec is not None:
            _require(isinstance(self.kv_store_ec, str), f"kv_store_ec must be K+M, got {self.kv_store_ec!r}")
            _store_cluster_ec(self.kv_store_ec)

    @property
    def num_swa_store_slots(self) -> int:
        return 4 * self.max_num_seqs if self.swa_store_slots is None else self.swa_store_slots

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise EngineOptionsError(f"unknown engine option {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


def _require(is_ok: bool, message: str) -> None:
    if not is_ok:
        raise EngineOptionsError(message)


def _store_cluster(nodes, ec):
    from deepinfer.engine.kv_store_cluster import StoreClusterError, resolve_store_cluster

    try:
        return resolve_store_cluster(nodes, ec)
    except StoreClusterError as exc:
        raise EngineOptionsError(str(exc)) from None


def _store_cluster_ec(ec: str) -> None:
    from deepinfer.engine.kv_store_cluster import StoreClusterError, parse_ec

    try:
        parse_ec(ec)
    except StoreClusterError as exc:
        raise EngineOptionsError(str(exc)) from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_seconds(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")


@dataclass(slots=True)
class EngineParts:
    core: EngineCore
    model_config: FamilyConfig
    tokenizer: Tokenizer | None
    structured_output: StructuredOutputBackend | None
    max_model_len: int
    served_model_name: str
    created: int
    swa_slots: SwaSlotManager | None = None  # SWA slot store / replay policy (build_engine attaches it)
    kv_offload: KVOffload | None = None  # KV tiers built by build_engine (closed by whoever owns the parts)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def build_engine(model_dir: str | Path, options: EngineOptions) -> EngineParts:
    """Load ``model_dir`` and build the core (blocking: reads the weights)."""
    device = resolve_device(options.device)
    if options.num_threads:
        torch.set_num_threads(options.num_threads)
    cfg = read_model_config(model_dir)
    # "auto": the checkpoint's dtype on GPUs; float32 on CPU (bf16 GEMMs are slow on most CPUs)
    compute = resolve_dtype("float32" if options.dtype == "auto" and device == "cpu" else options.dtype, cfg)
    cfg, state = family(cfg.model_type).load_checkpoint(model_dir, dtype=compute, device=device, progress=False)
    max_model_len = min(options.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    bs = options.block_size
    blocks_per_seq = -(-max_model_len // bs)
    runner = ModelRunner(cfg, state, num_blocks=1, num_slots=options.max_num_seqs, block_size=bs,
                         lookahead=options.lookahead, device=device, dtype=compute,
                         batch_invariant=options.batch_invariant)
    del state
    num_blocks = options.num_blocks
    if num_blocks is None and options.kv_cache_memory_bytes is not None:
        num_blocks = options.kv_cache_memory_bytes // max(runner.blocks.bytes_per_block, 1)
        if num_blocks < 1:
            raise EngineOptionsError(f"kv_cache_memory_bytes {options.kv_cache_memory_bytes} holds no KV block "
                                     f"({runner.blocks.bytes_per_block} bytes each); raise it")
    if num_blocks is None:
        num_blocks = options.max_num_seqs * blocks_per_seq
    # a sequence longer than the whole pool could never run (it would preempt itself forever)
    max_model_len = min(max_model_len, num_blocks * bs)
    # the runner's pool is sized once the bytes per block are known (it was built with one block)
    runner.blocks = BlockCache(runner.blocks.specs, num_blocks=num_blocks, block_size=bs, dtype=compute,
                               device=runner.device)
    tokenizer = None if options.skip_tokenizer_init else Tokenizer.from_dir(model_dir)
    eos = tokenizer.eos_token_ids if tokenizer is not None else cfg.eos_token_id
    eos_ids = tuple(eos or ())
    backend = None
    if tokenizer is not None:
        backend = StructuredOutputBackend.from_hf_tokenizer(tokenizer.hf_tokenizer, eos_ids, vocab_size=cfg.vocab_size,
                                                            any_whitespace=options.json_any_whitespace)
    name = options.served_model_name or Path(model_dir).name
    sched = SchedulerConfig(
        block_size=bs,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=options.enable_prefix_caching,
        max_replay_tokens=cfg.sliding_window * cfg.num_hidden_layers,
        model_id=name,
        step_time_target_s=options.step_time_target_s,
    )
    core_cfg = EngineCoreConfig(sched, num_blocks=num_blocks, vocab_size=cfg.vocab_size, eos_token_ids=eos_ids,
                                device=str(runner.device),
                                max_num_waiting=options.max_num_waiting)
    detok_factory = decode_token = None
    if tokenizer is not None:
        def detok_factory(prompt_ids, params):
            return tokenizer.detokenizer(params.skip_special_tokens, prompt_token_ids=prompt_ids)

        def decode_token(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

    offload = _build_kv_offload(runner, options)
    try:
        core = EngineCore(runner, core_cfg, detokenizer_factory=detok_factory,
                          decode_token=decode_token, structured_output=backend, seed_rng=random.Random(options.seed),
                          kv_offload=offload)
        swa = None
        if options.num_swa_store_slots > 0 or options.swa_replay != "exact":
            swa = attach_swa_slots(core, mode=options.swa_replay, replay_tokens=options.swa_replay_tokens,
                                   num_store_slots=options.num_swa_store_slots,
                                   fetch_deadline_s=options.swa_fetch_deadline_s,
                                   snapshot_prompts=options.swa_snapshot_prompts)
            if swa.store is not None and options.num_swa_store_slots > 0:
                log.info("SWA slot store: %d slots x %d bytes = %.1f MiB of host memory", swa.store.num_slots,
                         swa.store.layout.num_bytes, swa.store.arena.numel() / 2**20)
    except BaseException:
        if offload is not None:
            offload.close()
        raise
    return EngineParts(core, cfg, tokenizer, backend, max_model_len, name, int(time.time()), swa, offload)


def _build_kv_offload(runner: ModelRunner, options: EngineOptions) -> KVOffload | None:
    env = envs.get()
    host_bytes = env.kv_host_tier_bytes if options.kv_host_tier_bytes is None else options.kv_host_tier_bytes
    cluster = kv_store_cluster(options)
    if not host_bytes and not options.kv_store_dir and cluster is None:
        return None
    deadline = env.kv_load_deadline_s if options.kv_load_deadline_s is None else options.kv_load_deadline_s
    if not deadline > 0:
        raise EngineOptionsError(f"DEEPINFER_KV_LOAD_DEADLINE_S must be > 0 seconds, got {deadline!r}")
    store = None
    if options.kv_store_dir:
        from deepinfer.cache.store.fs_backend import FsStore

        store = FsStore(Path(options.kv_store_dir).expanduser())
    elif cluster is not None:
        from deepinfer.engine.kv_store_cluster import build_cluster_store

        store = build_cluster_store(cluster)
        log.info("KV store: %s", cluster.describe())
    # the cluster store's sockets start on KVOffload's I/O loop, which serves every store call
    # (the serving loop never decodes fragments); KVOffload.close closes them
    return KVOffload.build(runner, host_capacity_bytes=host_bytes, store=store,
                           config=KVOffloadConfig(load_deadline_s=float(deadline)))


def kv_store_cluster(options: EngineOptions):
    """The storage cluster ``options`` (or DEEPINFER_KV_STORE_NODES / _EC) name; None: no cluster.
    The environment applies only when the options name no store; naming both is an error."""
    env = envs.get()
    nodes, ec = options.kv_store_nodes, options.kv_store_ec
    if nodes is None and env.kv_store_nodes:
        if options.kv_store_dir:
            raise EngineOptionsError("DEEPINFER_KV_STORE_NODES and kv_store_dir both name a KV store; unset one")
        nodes = env.kv_store_nodes
    if nodes is None:
        return None
    if ec is None and env.kv_store_ec and not _is_config_path(nodes):
        ec = env.kv_store_ec
    return _store_cluster(nodes, ec)


def _is_config_path(nodes) -> bool:
    return isinstance(nodes, str) and "://" not in nodes
