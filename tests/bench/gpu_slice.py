"""The models of `deepinfer bench gpu`, built on the GPU, and the two numbers of each (bytes and
flops a token must cost), plus our greedy generate driven straight through the runner.

``flash_slice`` is a V4-Flash-shaped slice: transformers' DeepseekV4Config defaults (hidden 4096,
64 heads x 512, q/o low rank 1024, window 128, CSA ratio 4 with the 64 x 128 indexer and top-512,
HCA ratio 128, hc_mult 4) cut to 4 layers CSA/HCA/CSA/HCA with 64 routed experts of 2048 (top-6)
+ 1 shared, no hash layers: 8.1B parameters. Weights are random on the GPU with the rules of
``testing.randomize_`` (O(1) activations, non-zero sinks, biases and position biases); the
modules transformers keeps in float32 stay float32, the rest is bfloat16.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deepinfer.engine.models.deepseek_v4 import testing
from deepinfer.engine.models.deepseek_v4.testing import CSA, HCA

try:
    from deepinfer.engine.core.batch import ForwardBatch, SeqStep, TokenSource
except ImportError:  # before the engine's reorganisation
    from deepinfer.engine.batch import ForwardBatch, SeqStep

FLASH_SLICE = dict(
    num_hidden_layers=4, layer_types=[CSA, HCA, CSA, HCA], mlp_layer_types=["moe"] * 4, n_routed_experts=64,
    max_position_embeddings=65536,
)  # fmt: skip


@dataclass(slots=True)
class Floors:
    """What one token costs at least: weight bytes read by a batch-1 decode step (embedding: one
    row; experts: the k routed + shared ones) and matrix flops of a prefill token (no lm_head)."""

    decode_bytes: int
    prefill_flops_per_token: float
    num_params: int


def _randomize_on_gpu(model, seed: int) -> None:
    """``testing.randomize_``'s rules, drawn on the GPU (8B values on the host take minutes)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            noise = torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float32)
            if name.endswith(("norm.weight", "layernorm.weight")):
                noise = 1 + 0.1 * noise
            elif name.endswith("sinks"):
                pass
            elif name.endswith("position_bias"):
                noise = 0.5 * noise
            elif name.endswith("e_score_correction_bias"):
                noise = 0.2 * noise
            elif name.endswith((".scale", "hc_scale")):
                noise = 1 + 0.2 * noise
            elif name.endswith((".base", "hc_base")):
                noise = 0.2 * noise
            else:
                noise = noise / t.shape[-1] ** 0.5
            t.copy_(noise)
            del noise


def flash_slice(seed: int = 0, **overrides) -> testing.Reference:
    """transformers' model of the slice on the GPU (bf16, its float32 modules kept) and ours'
    config + canonical state dict sharing its tensors."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(**{**FLASH_SLICE, **overrides})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = DeepseekV4ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for name, p in model.named_parameters():
        if set(name.split(".")) & keep:
            p.data = p.data.float()
    model.eval()
    _randomize_on_gpu(model, seed)
    model.generation_config.eos_token_id = None
    state = {k.removeprefix("model."): v for k, v in model.state_dict().items()}
    return testing.Reference(model, testing.ModelConfig.from_dict(cfg.to_dict()), state)


def tiny_model(seed: int = 0, **shape) -> testing.Reference:
    """A tiny random model (built on the host, moved to the GPU in bf16)."""
    ref = testing.hf_reference(seed=seed, **shape)
    ref.hf_model.to("cuda", torch.bfloat16)
    ref.hf_model.generation_config.eos_token_id = None
    return ref


def _weights(model: torch.nn.Module):
    """(name, dims, numel, bytes) of every parameter and of every FP8 weight the model serves from
    (``quantization="fp8"``: attributes holding kernels/fp8.py ``Fp8Weight``, data + scales)."""
    for name, p in model.named_parameters():
        yield name, p.dim(), p.numel(), p.numel() * p.element_size()
    try:
        from deepinfer.kernels.fp8 import Fp8Weight
    except ImportError:  # a tree without FP8 weights
        return
    for prefix, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, Fp8Weight):
                yield f"{prefix}.{attr}", value.dim(), value.data.numel(), value.nbytes


def floors(model: torch.nn.Module, config) -> Floors:
    """Byte and flop floors of our model (its weights as served: FP8 ones at 1 byte + scales)."""
    total = embed = experts = expert_params = num_params = 0
    matrix = 0
    for name, dims, numel, nbytes in _weights(model):
        num_params += numel
        total += nbytes
        if name.startswith("embed_tokens"):
            embed += nbytes
        elif ".mlp.experts." in name:
            experts += nbytes
            expert_params += numel
        elif dims >= 2 and not name.startswith("lm_head"):
            matrix += numel
    if config.tie_word_embeddings:
        embed = 0
    e, k = config.n_routed_experts, config.num_experts_per_tok
    row = config.hidden_size * model.embed_tokens.weight.element_size()
    decode = total - embed + row - experts * (e - k) // e
    flops = 2.0 * (matrix + expert_params * k / e)
    return Floors(decode_bytes=decode, prefill_flops_per_token=flops, num_params=num_params)


def hf_generate(ref, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = ref.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                    do_sample=False, pad_token_id=0)  # fmt: skip
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out[:, ids.shape[1] :].tolist()


def hf_prefill(ref, prompt: list[int]) -> float:
    ids = torch.tensor([prompt], device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        ref.hf_model(ids, logits_to_keep=1, use_cache=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@dataclass(slots=True)
class Generated:
    seconds: float  # the whole generate: prefill + every decode step
    decode_seconds: float  # the decode steps only
    tokens: list[list[int]]


def our_generate(runner, prompts: list[list[int]], new_tokens: int, blocks_per_seq: int, *,
                 fed: bool = True) -> Generated:
    """Greedy generate: one forward for all prompts, then one per new token for the whole batch,
    argmax on the device. ``fed`` (default): each decode step takes the previous step's ids from
    the device (``ForwardBatch.token_source``) and is launched before the host reads them; the
    host copies step N's ids into pinned memory behind an event and waits only for that, so it
    builds step N+2's context while N+1 runs. ``fed=False``: one blocking host read per step
    before the next is built (the device idles while the host works)."""
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    n = len(prompts)
    rows = list(range(n))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = [SeqStep(i, i, tables[i], 0, p, num_logits=1) for i, p in enumerate(prompts)]
    ids = runner.execute(ForwardBatch(steps)).argmax(-1)
    if fed:
        torch.cuda.synchronize()  # (decode_seconds counts decode steps only)
    else:
        last = ids.tolist()
    t1 = time.perf_counter()
    tokens: list[list[int]] = [[] for _ in prompts]
    for k in range(1, new_tokens):
        if fed:
            host = torch.empty(n, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            steps = [SeqStep(i, i, tables[i], len(p) + k - 1, [0], num_logits=1) for i, p in enumerate(prompts)]
            nxt = runner.execute(ForwardBatch(steps, token_source=TokenSource(ids, rows, rows))).argmax(-1)
            copied.synchronize()
            for i, t in enumerate(host.tolist()):
                tokens[i].append(t)
            ids = nxt
        else:
            for i, t in enumerate(last):
                tokens[i].append(t)
            steps = [SeqStep(i, i, tables[i], len(p) + k - 1, [last[i]], num_logits=1) for i, p in enumerate(prompts)]
            last = runner.execute(ForwardBatch(steps)).argmax(-1).tolist()
    for i, t in enumerate(ids.tolist() if fed else last):
        tokens[i].append(t)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return Generated(t2 - t0, t2 - t1, tokens)


def engine_generate(runner, prompts: list[list[int]], new_tokens: int, *, feed_ids: bool) -> Generated:
    """The same greedy generate through the engine (EngineCore: scheduler, sampler, commit; the
    pipelined step loop with its device thread), ``feed_ids`` on or off (device_chain.py).
    ``decode_seconds``: from the first output on. Prefix caching off (no hits between runs)."""
    import asyncio
    import random
    from concurrent.futures import ThreadPoolExecutor

    from deepinfer.engine.api.sampling_params import SamplingParams
    from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
    from deepinfer.engine.core.step_loop import AsyncStepPipeline
    from deepinfer.engine.sched.scheduler import SchedulerConfig

    bs = runner.block_size
    sched = SchedulerConfig(block_size=bs, max_num_seqs=runner.num_slots, max_num_batched_tokens=32768,
                            max_model_len=runner.blocks.num_blocks * bs // max(1, len(prompts)),
                            enable_prefix_caching=False, model_id="gpu-slice")  # fmt: skip
    cfg = EngineCoreConfig(sched, num_blocks=runner.blocks.num_blocks, vocab_size=runner.config.vocab_size,
                           device=runner.device.type)  # fmt: skip
    core = EngineCore(runner, cfg, seed_rng=random.Random(0))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}

    async def drive(pipe) -> float | None:
        first = None
        while pipe.has_work():
            for out in await pipe.step():
                first = first or time.perf_counter()
                tokens[out.request_id].extend(out.outputs[0].token_ids if out.outputs else ())
        return first

    with ThreadPoolExecutor(1) as ex:
        pipe = AsyncStepPipeline(core, ex, feed_ids=feed_ids)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            core.add_request(f"r{i}", p, params)
        first = asyncio.run(drive(pipe))
        t2 = time.perf_counter()
    return Generated(t2 - t0, t2 - (first or t0), [tokens[f"r{i}"] for i in range(len(prompts))])


def our_prefill(runner, prompt: list[int], blocks_per_seq: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.execute(ForwardBatch([SeqStep(0, 0, list(range(blocks_per_seq)), 0, prompt, num_logits=1)]))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def prefill_batch(prompts: list[list[int]], blocks_per_seq: int) -> ForwardBatch:
    """The generate's first forward: every prompt whole, one logit row each (for profiling it)."""
    return ForwardBatch([SeqStep(i, i, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), 0, p, num_logits=1)
                         for i, p in enumerate(prompts)])  # fmt: skip


def decode_batch(prompts: list[list[int]], blocks_per_seq: int, step: int, tokens: list[int]) -> ForwardBatch:
    """The decode forward after ``step`` new tokens (for profiling one step)."""
    return ForwardBatch([SeqStep(i, i, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), len(p) + step,
                                 [tokens[i]], num_logits=1) for i, p in enumerate(prompts)])  # fmt: skip
