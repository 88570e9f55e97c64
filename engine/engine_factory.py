"""Build an ``EngineCore`` (runner, tokenizer, structured-output backend) from a model directory.

``EngineOptions`` holds every engine knob with its default; ``build_engine(model_dir, options)``
loads the checkpoint, sizes the KV block pool and wires the core. It blocks (weights are read
from disk), so AsyncEngine calls it in an executor.

KV pool size: ``num_blocks`` when given; else ``kv_cache_memory_bytes / bytes_per_block`` when a
budget is given; else room for ``max_num_seqs`` sequences of ``max_model_len`` tokens each (the
pool never preempts then). ``max_model_len`` defaults to the model's context length.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from deepinfer.cache.block_cache import BlockCache
from deepinfer.engine.batch import ForwardBatch
from deepinfer.engine.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.scheduler import SchedulerConfig
from deepinfer.engine.structured_output import StructuredOutputBackend
from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.engine.weights import load_checkpoint, resolve_dtype


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

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise EngineOptionsError(f"unknown engine option {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


@dataclass(slots=True)
class EngineParts:
    core: EngineCore
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    structured_output: StructuredOutputBackend | None
    max_model_len: int
    served_model_name: str
    created: int


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def build_engine(model_dir: str | Path, options: EngineOptions) -> EngineParts:
    """Load ``model_dir`` and build the core (blocking: reads the weights)."""
    device = resolve_device(options.device)
    if options.num_threads:
        torch.set_num_threads(options.num_threads)
    cfg = ModelConfig.from_dir(model_dir)
    # "auto": the checkpoint's dtype on GPUs; float32 on CPU (bf16 GEMMs are slow on most CPUs)
    compute = resolve_dtype("float32" if options.dtype == "auto" and device == "cpu" else options.dtype, cfg)
    cfg, state = load_checkpoint(model_dir, dtype=compute, device=device, progress=False)
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
                                device=str(runner.device))
    detok_factory = decode_token = None
    if tokenizer is not None:
        def detok_factory(prompt_ids, params):
            return tokenizer.detokenizer(params.skip_special_tokens, prompt_token_ids=prompt_ids)

        def decode_token(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

    core = EngineCore(_AnyBatchRunner(runner), core_cfg, detokenizer_factory=detok_factory, decode_token=decode_token,
                      structured_output=backend, seed_rng=random.Random(options.seed))
    return EngineParts(core, cfg, tokenizer, backend, max_model_len, name, int(time.time()))


class _AnyBatchRunner:
    """The runner as EngineCore sees it: also accepts a batch of middle prefill chunks only
    (no logit rows), which the V4 head does not take yet."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.num_logits == 0:
            # TODO(model): the V4 head fails on 0 rows; compute one throwaway row meanwhile.
            last = batch.steps[-1]
            last.num_logits = 1
            try:
                self.runner.execute(batch)
            finally:
                last.num_logits = 0
            return torch.zeros(0, self.runner.config.vocab_size, device=self.runner.device)
        return self.runner.execute(batch)
