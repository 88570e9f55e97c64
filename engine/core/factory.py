"""Build an ``EngineCore`` and its parts from a model directory: ``build_engine(model_dir, options)``.

Loads the checkpoint (through the model registry), sizes the KV block pool (engine/core/options.py
says how), builds the optional parts first (KV tiers, SWA slots, the DSpark drafter with its SPS
table measured on this runner) and gives them to the core at construction (engine/core/hooks.py). It blocks (weights are read from disk), so AsyncEngine calls
it in an executor.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from deepinfer import envs
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.core.hooks import EngineHooks
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.core.options import EngineOptions, EngineOptionsError, kv_store_cluster
from deepinfer.engine.kv.offload import KVOffload, KVOffloadConfig
from deepinfer.engine.kv.swa_slots import SwaSlotManager, build_swa_slots
from deepinfer.engine.loader.weights import resolve_dtype
from deepinfer.engine.mm.encoder import VisionEncoder
from deepinfer.engine.models.registry import FamilyConfig, family, read_model_config
from deepinfer.engine.sample.structured_output import StructuredOutputBackend
from deepinfer.engine.sched.scheduler import SchedulerConfig
from deepinfer.engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    core: EngineCore
    model_config: FamilyConfig
    tokenizer: Tokenizer | None
    structured_output: StructuredOutputBackend | None
    max_model_len: int
    served_model_name: str
    created: int
    swa_slots: SwaSlotManager | None = None  # SWA slot store / replay policy (given to the core at construction)
    kv_offload: KVOffload | None = None  # KV tiers built by build_engine (closed by whoever owns the parts)
    vision: VisionEncoder | None = None  # a vision model's preprocessing + tower (options.load_vision)


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

    def pool_size(bytes_per_block: int) -> int:
        """The runner's KV pool, sized once the bytes of one block are known (options.py)."""
        if options.num_blocks is not None:
            return options.num_blocks
        if options.kv_cache_memory_bytes is not None:
            num = options.kv_cache_memory_bytes // max(bytes_per_block, 1)
            if num < 1:
                raise EngineOptionsError(f"kv_cache_memory_bytes {options.kv_cache_memory_bytes} holds no KV block "
                                         f"({bytes_per_block} bytes each); raise it")
            return num
        return options.max_num_seqs * blocks_per_seq

    runner = ModelRunner(cfg, state, num_blocks=pool_size, num_slots=options.max_num_seqs, block_size=bs,
                         lookahead=options.lookahead, device=device, dtype=compute,
                         batch_invariant=options.batch_invariant, quantization=options.quantization)
    del state
    if options.expert_parallel is not None:  # one rank of an EP group: its experts only, steps in lockstep
        from deepinfer.engine.parallel.settings import build_ep_runner

        runner = build_ep_runner(runner, options.expert_parallel)
    num_blocks = runner.blocks.num_blocks
    plain_runner = runner  # DSpark's drafter and SPS calibration read the model itself
    # a sequence longer than the whole pool could never run (it would preempt itself forever)
    max_model_len = min(max_model_len, num_blocks * bs)
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
        max_num_spec_tokens=options.num_draft_tokens if options.speculative != "off" else 0,
    )
    # a family with a vision tower names its image token (V4.1's config: image_token_id + vision)
    image_token = getattr(cfg, "image_token_id", None) if getattr(cfg, "vision", None) is not None else None
    core_cfg = EngineCoreConfig(sched, num_blocks=num_blocks, vocab_size=cfg.vocab_size, eos_token_ids=eos_ids,
                                device=str(runner.device), image_token_id=image_token,
                                hidden_size=getattr(cfg, "hidden_size", None) if image_token is not None else None,
                                max_num_waiting=options.max_num_waiting)
    vision = VisionEncoder.load(model_dir, cfg, dtype=compute, device=device) if options.load_vision else None
    detok_factory = tokenizer.detokenizer_for if tokenizer is not None else None
    decode_token = tokenizer.decode_token if tokenizer is not None else None

    offload = _build_kv_offload(runner, options)
    try:
        swa = None
        if options.num_swa_store_slots > 0 or options.swa_replay != "exact":
            swa_parts = build_swa_slots(runner, sched, mode=options.swa_replay,
                                        replay_tokens=options.swa_replay_tokens,
                                        num_store_slots=options.num_swa_store_slots,
                                        fetch_deadline_s=options.swa_fetch_deadline_s,
                                        snapshot_prompts=options.swa_snapshot_prompts)
            swa, runner = swa_parts.manager, swa_parts.runner
            core_cfg = replace(core_cfg, scheduler=swa_parts.scheduler)
            if options.num_swa_store_slots > 0:
                log.info("SWA slot store: %d slots x %d bytes = %.1f MiB of host memory", swa.store.num_slots,
                         swa.store.layout.num_bytes, swa.store.arena.numel() / 2**20)
        spec = _build_spec(plain_runner, cfg, model_dir, options, max_model_len) if options.speculative != "off" else None
        core = EngineCore(runner, core_cfg, detokenizer_factory=detok_factory,
                          decode_token=decode_token, structured_output=backend, seed_rng=random.Random(options.seed),
                          hooks=EngineHooks(swa_slots=swa, kv_offload=offload, spec=spec))
    except BaseException:
        if offload is not None:
            offload.close()
        raise
    return EngineParts(core, cfg, tokenizer, backend, max_model_len, name, int(time.time()), swa, offload, vision)


def _build_spec(runner: ModelRunner, cfg: FamilyConfig, model_dir: str | Path, options: EngineOptions,
                max_model_len: int):
    """The DSpark part of the core (engine/spec/build.py): the family's drafter over the loaded
    model, its context ring and the SPS table measured here, before any request."""
    from deepinfer.engine.spec.build import build_spec_decoding

    build = family(cfg.model_type).build_drafter
    if build is None:
        raise EngineOptionsError(f"speculative={options.speculative!r}: the {cfg.model_type} family has no drafter")
    if options.expert_parallel is not None:
        raise EngineOptionsError("speculative decoding does not run with expert parallelism yet; use speculative='off'")
    try:
        drafter = build(runner.model, model_dir=model_dir)
    except ValueError as e:  # no drafter stages in the checkpoint, a bad calibration file
        raise EngineOptionsError(f"speculative={options.speculative!r}: {e}") from None
    if options.num_draft_tokens > drafter.block_size:
        raise EngineOptionsError(f"num_draft_tokens {options.num_draft_tokens} exceeds the drafter's block of "
                                 f"{drafter.block_size} tokens")
    return build_spec_decoding(runner, drafter, num_draft_tokens=options.num_draft_tokens,
                               schedule=options.spec_schedule, max_num_seqs=options.max_num_seqs,
                               max_model_len=max_model_len, block_size=options.block_size,
                               max_num_batched_tokens=options.max_num_batched_tokens)


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
        from deepinfer.engine.kv.store_cluster import build_cluster_store

        store = build_cluster_store(cluster)
        log.info("KV store: %s", cluster.describe())
    # the cluster store's sockets start on KVOffload's I/O loop, which serves every store call
    # (the serving loop never decodes fragments); KVOffload.close closes them
    return KVOffload.build(runner, host_capacity_bytes=host_bytes, store=store,
                           config=KVOffloadConfig(load_deadline_s=float(deadline)))
