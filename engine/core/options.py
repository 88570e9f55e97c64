"""``EngineOptions``: every engine knob with its default, checked when built (one-line errors).

KV pool size: ``num_blocks`` when given; else ``kv_cache_memory_bytes / bytes_per_block`` when a
budget is given; else room for ``max_num_seqs`` sequences of ``max_model_len`` tokens each (the
pool never preempts then). ``max_model_len`` defaults to the model's context length.

SWA slots: ``swa_replay`` sets how a prefix hit's sliding-window state is replayed; a host slot
store (``swa_store_slots``) saves finished sequences' states so a continuation restores them
(engine/kv/swa_slots.py). With ``swa_directory`` the engine also shares slots with other engines;
the sockets for that start on the serving loop (AsyncEngine, cache/swa_peer.py). KV tiers
(``kv_host_tier_bytes``, ``kv_store_dir`` or the storage cluster ``kv_store_nodes``) extend the prefix
cache past the device pool.

Speculative decoding: ``speculative="dspark"`` drafts with the checkpoint's DSpark stages and
verifies up to ``num_draft_tokens`` drafts per request and step, as many as ``spec_schedule``
picks ("confidence": the hardware-aware length schedule over the step's SPS table, measured at
start-up, keeping the accepted length near verifying all; "throughput": the same without that
floor, the drafter skipped while drafting does not pay; "fixed": all of them). A step rolls back
at most ``lookahead`` positions, so ``num_draft_tokens`` must stay below it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from deepinfer import envs
from deepinfer.engine.core.model_runner import QUANTIZATIONS
from deepinfer.engine.kv.swa_replay import SWA_REPLAY_MODES
from deepinfer.engine.spec.length_policy import SCHEDULES

SPECULATIVE_MODES = ("off", "dspark")  # --speculative

if TYPE_CHECKING:
    from deepinfer.engine.parallel.settings import ExpertParallelSpec


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
    # a model with a vision tower loads it and encodes the images of its own requests; False: the
    # engine takes image embeddings made elsewhere only (a prefill engine behind encoder nodes)
    load_vision: bool = True
    # SWA slots (engine/kv/swa_slots.py, ARCHITECTURE.md, "Caches"). A prefix hit whose sliding-window state
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
    # the erasure-coded storage cluster (engine/kv/store_cluster.py): storage node addresses
    # ("tcp://H:P,tcp://H:P,..." or a list) or a storage membership file (.json); a cluster config
    # file is the runtime's to read (runtime/kv_store_cluster.py). None: DEEPINFER_KV_STORE_NODES
    # ("" = none). Not with kv_store_dir. kv_store_ec: "K+M" of an address list (None:
    # DEEPINFER_KV_STORE_EC, else 10+2); a membership file carries its own
    kv_store_nodes: str | tuple[str, ...] | list[str] | None = None
    kv_store_ec: str | None = None
    kv_load_deadline_s: float | None = None
    # this engine as one rank of an expert-parallel group (engine/parallel/settings.py): its MoE
    # layers keep only its experts' slots and every forward is a step of the whole group
    expert_parallel: ExpertParallelSpec | None = None
    # DSpark speculative decoding (engine/spec/): "off" | "dspark"; drafts per request and step;
    # which of them are verified ("confidence" | "throughput" | "fixed")
    speculative: str = "off"
    num_draft_tokens: int = 5
    spec_schedule: str = "confidence"
    # "fp8": serve the GEMM weights the checkpoint stores in FP8/FP4 as block-scaled FP8
    # (kernels/fp8.py; Triton FP8 GEMMs on NVIDIA GPUs, the torch reference elsewhere); None: the
    # compute dtype
    quantization: str | None = None

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
        self._check_spec()
        _require(self.quantization in (None, *QUANTIZATIONS),
                 f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {self.quantization!r}")
        _require(self.quantization is None or self.expert_parallel is None,
                 "quantization and expert parallelism cannot be combined yet (expert slots are dense weights)")

    def _check_spec(self) -> None:
        _require(self.speculative in SPECULATIVE_MODES,
                 f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {self.speculative!r}")
        _require(self.spec_schedule in SCHEDULES,
                 f"spec_schedule must be one of {', '.join(SCHEDULES)}, got {self.spec_schedule!r}")
        d = self.num_draft_tokens
        _require(_is_int(d) and d >= 1, f"num_draft_tokens must be an integer >= 1, got {d!r}")
        _require(_is_int(self.lookahead) and self.lookahead >= 0,
                 f"lookahead must be an integer >= 0, got {self.lookahead!r}")
        if self.speculative != "off":
            _require(d + 1 <= self.lookahead, f"num_draft_tokens {d} needs lookahead >= {d + 1} (positions a "
                                              f"speculative step may roll back), got {self.lookahead}")

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
    from deepinfer.engine.kv.store_cluster import StoreClusterError, resolve_store_cluster

    try:
        return resolve_store_cluster(nodes, ec)
    except StoreClusterError as exc:
        raise EngineOptionsError(str(exc)) from None


def _store_cluster_ec(ec: str) -> None:
    from deepinfer.engine.kv.store_cluster import StoreClusterError, parse_ec

    try:
        parse_ec(ec)
    except StoreClusterError as exc:
        raise EngineOptionsError(str(exc)) from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_seconds(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")


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
