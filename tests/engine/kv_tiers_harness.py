"""A tiny real DeepSeek-V4 engine with KV tiers, for the kv-tiers tests (in-process or as a child).

Load it from a test with ``_helper("kv_tiers_harness")`` (tests/ has no packages). As a program it
runs one engine instance against a storage cluster and prints one JSON line::

    python kv_tiers_harness.py --nodes '{"node-00": "tcp://...", ...}' --k 4 --m 2 \
        --prompt-seed 7 --prompt-len 2000 --max-tokens 8
    {"token_ids": [...], "num_cached_tokens": 1920, "cached_tokens_by_tier": {...}, "stats": {...}}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import runpy
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.core.hooks import EngineHooks
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.kv.offload import KVOffload, KVOffloadConfig
from deepinfer.engine.models.deepseek_v4.tiny_model import init_weights, tiny_config
from deepinfer.engine.sched.scheduler import SchedulerConfig
from deepinfer.engine.text.output_processor import merge_output

StepPipeline = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench" / "sync_steps.py"))["StepPipeline"]

LAYERS = "WCH"  # one layer of each kind: window-only, CSA (compressed + indexer keys), HCA
BLOCK_SIZE = 128  # a multiple of the HCA ratio (128)
MODEL_SEED = 0

_model_cache: dict = {}


def model():
    if "cfg" not in _model_cache:
        cfg = tiny_config(LAYERS, num_hash_layers=1)
        _model_cache["cfg"], _model_cache["weights"] = cfg, init_weights(cfg, MODEL_SEED)
    return _model_cache["cfg"], _model_cache["weights"]


def make_runner(num_blocks: int, num_slots: int = 4) -> ModelRunner:
    cfg, weights = model()
    return ModelRunner(cfg, weights, num_blocks=num_blocks, num_slots=num_slots, block_size=BLOCK_SIZE)


def make_core(runner: ModelRunner, num_blocks: int, offload: KVOffload | None, budget: int = 2048) -> EngineCore:
    cfg = runner.config
    sched = SchedulerConfig(block_size=BLOCK_SIZE, max_num_seqs=runner.num_slots, max_num_batched_tokens=budget,
                            max_model_len=4096, model_id="tiny-v4-kv-tiers",
                            # the SWA state at the hit boundary is rebuilt by exact replay
                            max_replay_tokens=cfg.sliding_window * cfg.num_hidden_layers)
    return EngineCore(runner, EngineCoreConfig(sched, num_blocks=num_blocks, vocab_size=cfg.vocab_size),
                      seed_rng=random.Random(0), hooks=EngineHooks(kv_offload=offload))


def prompt(seed: int, length: int) -> list[int]:
    cfg, _ = model()
    rng = random.Random(seed)
    return [rng.randrange(3, cfg.vocab_size) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]], max_steps: int = 10_000) -> dict:
    """Run requests to completion through the pipelined loop (device work on its own thread);
    request id -> merged RequestOutput (the pipeline queues the last write-behind copies on the
    device thread when it goes idle)."""
    for rid, ids, params in requests:
        core.add_request(rid, ids, params)
    done: dict = {}
    with ThreadPoolExecutor(1, thread_name_prefix="device") as device:
        pipe = StepPipeline(core, device)
        for _ in range(max_steps):
            if not pipe.has_work():
                break
            outs = pipe.step()
            for out in outs:
                done[out.request_id] = merge_output(done.get(out.request_id), out)
            if not outs and core.kv_offload is not None:
                core.kv_offload.wait_for_loads(0.01)  # nothing to run but requests waiting for KV
            core.check_integrity()
        else:
            raise AssertionError(f"requests not finished after {max_steps} steps")
    return done


def summary(out, offload: KVOffload | None) -> dict:
    return {
        "token_ids": list(out.outputs[0].token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "cached_tokens_by_tier": dict(out.metrics.cached_tokens_by_tier),
        "ttft_s": out.metrics.first_token_time - out.metrics.arrival_time,
        "stats": dataclasses.asdict(offload.stats) if offload is not None else {},
    }


def main(argv: list[str] | None = None) -> int:
    from deepinfer.cache.store.client import ClusterStore, ClusterStoreConfig
    from deepinfer.cache.store.ec import ECConfig

    p = argparse.ArgumentParser()
    p.add_argument("--nodes", required=True, help="JSON object: storage node name -> address")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--prompt-seed", type=int, required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--load-deadline-s", type=float, default=5.0)
    args = p.parse_args(argv)
    num_blocks = args.prompt_len // BLOCK_SIZE + 8
    runner = make_runner(num_blocks)
    store = ClusterStore(json.loads(args.nodes), ClusterStoreConfig(ec=ECConfig(k=args.k, m=args.m)))
    offload = KVOffload.build(runner, host_capacity_bytes=64 << 20, store=store,
                              config=KVOffloadConfig(load_deadline_s=args.load_deadline_s))
    try:
        core = make_core(runner, num_blocks, offload)
        out = generate(core, [("r", prompt(args.prompt_seed, args.prompt_len), greedy(args.max_tokens))])["r"]
        if not offload.wait_for_writes(60):
            raise RuntimeError("write-behind did not reach the store within 60 s")
        print(json.dumps(summary(out, offload)), flush=True)
    finally:
        offload.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
