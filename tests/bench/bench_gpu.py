"""`deepinfer bench gpu`: our V4 engine next to transformers on one NVIDIA GPU (skips without one).

Both run the same random weights and prompts in one process, bf16, greedy:

- ceilings: a device-to-device copy (bytes read + written) and an 8192^3 bf16 matrix product
  on random data, each the median of several timed runs;
- the tiny bench model (tests/bench/bench_model.py's shape) at batch 1;
- the V4-Flash-shaped slice (tests/bench/gpu_slice.py, 8.1B parameters) at batch 1/16/64 with
  prompts of 1024/1024/512 tokens and 64/64/32 new tokens: tokens/s = batch * new tokens / time
  of the whole generate (prefill included), as issue 26 measured; decode-only tokens/s beside.
  "ours" is the model runner driven by a loop that feeds each decode step the previous step's
  ids on the device (gpu_slice.our_generate); ``engine_*`` the same generate through the
  serving engine (EngineCore + the pipelined step loop), with device-fed ids and without;
- the batch-1 roofline: measured copy bandwidth over the weight bytes a decode step must read
  (embedding: one row; experts: the 6 routed + shared ones), and ours against it; with
  ``--quantization fp8`` ours serves FP8 weights and the bytes are those it reads (1 per FP8
  weight + its block scales: the halved roofline issue 26 counts FP8 against);
- an 8,192-token prefill of both, with ours as a fraction of the measured bf16 matrix rate;
- CUDA kernels launched per decoded token (torch.profiler over decode steps at batch 1 and 64;
  ``--profile-dir`` writes the per-kernel tables of those steps);
- ``--kernels``: each Triton kernel next to its torch form (tests/bench/gpu_micro.py).

Prints the tables and, with ``--json PATH``, writes the figures (issue 26's keys among them).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from pathlib import Path

import torch
from deepinfer_bench.report import Report, base_parser

TINY_SHAPE_SOURCE = "bench_model"


def _median_ms(fn, repeats: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _copy_ms(numel: int) -> float:
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    return _median_ms(lambda: dst.copy_(src))


def ceilings() -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matrix TFLOP/s), measured here on random data."""
    copy_ms = _copy_ms(1 << 30)  # 4 GiB read, 4 GiB written per copy
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm_ms = _median_ms(lambda: a @ b)
    return 2 * 4 * (1 << 30) / (copy_ms * 1e-3) / 1e9, 2 * n**3 / (mm_ms * 1e-3) / 1e12


def _runner(ref, num_blocks: int, num_slots: int, quantization: str | None = None):
    try:
        from deepinfer.engine.core.model_runner import ModelRunner
    except ImportError:  # before the engine's reorganisation
        from deepinfer.engine.model_runner import ModelRunner
    kw = {"quantization": quantization} if quantization else {}
    return ModelRunner(ref.config, ref.state_dict, num_blocks=num_blocks, num_slots=num_slots, block_size=128,
                       device="cuda", dtype=torch.bfloat16, **kw)  # fmt: skip


def _prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def _secs(run) -> float:
    return run.seconds


def _same(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of generated tokens equal up to each sequence's first difference."""
    agree = total = 0
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        agree, total = agree + n, total + len(x)
    return agree / max(total, 1)


def count_launches(runner, prompts, blocks_per_seq: int, first_step: int, num_steps: int, table_path: Path | None):
    """(kernels, memcpys/memsets) per decoded token and device milliseconds per step (the step's
    kernels back to back: what a CUDA-graph replay costs) over ``num_steps`` eager decode steps."""
    tokens = [1] * len(prompts)
    graphs, runner.graphs = getattr(runner, "graphs", None), None  # the eager path's kernels
    try:
        return _count_launches(runner, prompts, blocks_per_seq, first_step, num_steps, table_path, tokens)
    finally:
        runner.graphs = graphs


def _count_launches(runner, prompts, blocks_per_seq, first_step, num_steps, table_path, tokens):
    from deepinfer_bench.gpu_slice import decode_batch

    runner.execute(decode_batch(prompts, blocks_per_seq, first_step, tokens))  # warm
    batches = [decode_batch(prompts, blocks_per_seq, first_step + 1 + s, tokens) for s in range(num_steps)]
    kernels, copies, device_ms = _profile(runner, batches, table_path, f"{num_steps} decode steps of batch {len(prompts)}")
    per_token = num_steps * len(prompts)
    return kernels / per_token, copies / per_token, device_ms / num_steps


def profile_prefill(runner, prompts, blocks_per_seq: int, table_path: Path | None) -> tuple[float, float]:
    """(wall ms, device ms) of the generate's first forward (every prompt whole) as the timed
    generate runs it (graphs on: a forward past DEEPINFER_CUDA_GRAPH_MAX_TOKENS runs eagerly on a
    context packed into one pinned copy), once profiled; ``table_path`` gets its per-kernel table."""
    from deepinfer_bench.gpu_slice import prefill_batch

    runner.execute(prefill_batch(prompts, blocks_per_seq))  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.execute(prefill_batch(prompts, blocks_per_seq))
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    tokens = sum(len(p) for p in prompts)
    _, _, device_ms = _profile(runner, [prefill_batch(prompts, blocks_per_seq)], table_path,
                               f"prefill of {len(prompts)} prompts, {tokens} tokens")
    return wall_ms, device_ms


def _profile(runner, batches, table_path: Path | None, title: str) -> tuple[int, int, float]:
    """(kernels, memcpys/memsets, device ms) of running ``batches`` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for batch in batches:
            runner.execute(batch)
        torch.cuda.synchronize()
    kernels = copies = 0
    device_us = 0.0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        device_us += evt.time_range.elapsed_us()  # a device event's range is its GPU run
        if evt.name.startswith(("Memcpy", "Memset")):
            copies += 1
        else:
            kernels += 1
    if table_path is not None:
        averages = prof.key_averages()
        for key in ("device_time_total", "cuda_time_total"):
            try:
                table = averages.table(sort_by=key, row_limit=30)
                break
            except (AttributeError, KeyError, ValueError):
                table = ""
        table_path.write_text(f"{title}\n{table}\n")
    return kernels, copies, device_us / 1e3


def tiny_part(report: Report, new_tokens: int) -> None:
    from deepinfer_bench.bench_model import BENCH_SHAPE
    from deepinfer_bench.gpu_slice import hf_generate, our_generate, tiny_model

    ref = tiny_model(seed=0, **BENCH_SHAPE)
    prompt_len = 256
    bps = -(-(prompt_len + new_tokens + 8) // 128)
    runner = _runner(ref, bps, 1)
    prompts = _prompts(ref.config.vocab_size, 1, prompt_len, 1)
    hf_generate(ref, prompts, 2)
    our_generate(runner, prompts, 2, bps)
    hf_s, hf_tokens = hf_generate(ref, prompts, new_tokens)
    ours = our_generate(runner, prompts, new_tokens, bps)
    report.row(model="tiny", batch=1, prompt=prompt_len, new=new_tokens, hf_tok_s=new_tokens / hf_s,
               ours_tok_s=new_tokens / ours.seconds, ours_vs_hf=hf_s / ours.seconds,
               ours_decode_tok_s=(new_tokens - 1) / ours.decode_seconds, same=_same(ours.tokens, hf_tokens))
    report.figure("tiny_hf_tok_s_b1", new_tokens / hf_s)
    report.figure("tiny_ours_tok_s_b1", new_tokens / ours.seconds)
    del runner, ref
    torch.cuda.empty_cache()


def slice_part(report: Report, args, copy_gbps: float, mm_tflops: float, profile_dir: Path | None) -> None:
    from deepinfer_bench.gpu_slice import (engine_generate, flash_slice, floors, hf_generate, hf_prefill, our_generate,
                                           our_prefill)

    batches = [int(b) for b in args.batch_sizes.split(",")]
    lengths = [int(n) for n in args.prompt_lens.split(",")]
    news = [int(n) for n in args.new_tokens.split(",")]
    t0 = time.perf_counter()
    ref = flash_slice(seed=args.seed)
    bps = -(-(max(lengths) + max(news) + 16) // 128)
    prefill_blocks = -(-(args.prefill_len + 16) // 128)
    runner = _runner(ref, max(max(batches) * bps, prefill_blocks), max(batches), args.quantization)
    fl = floors(runner.model, ref.config)
    roofline = copy_gbps * 1e9 / fl.decode_bytes
    report.figure("slice_params_b", fl.num_params / 1e9)
    report.figure("decode_bytes_b1_gb", fl.decode_bytes / 1e9)
    report.figure("roofline_tok_s_b1", roofline)
    print(f"slice built in {time.perf_counter() - t0:.1f} s: {fl.num_params / 1e9:.2f}B params, batch-1 step reads "
          f"{fl.decode_bytes / 1e9:.2f} GB -> roofline {roofline:.0f} tok/s at {copy_gbps:.0f} GB/s", flush=True)
    warm = _prompts(ref.config.vocab_size, 2, 300, 99)
    our_generate(runner, warm[:1], 3, bps)
    our_generate(runner, warm, 3, bps)
    if not args.skip_hf:
        hf_generate(ref, warm[:1], 3)
    for b, plen, new in zip(batches, lengths, news):
        prompts = _prompts(ref.config.vocab_size, b, plen, args.seed + b)
        graphs = runner.graphs
        eager = None
        if graphs is not None:  # the same generate eagerly first: the graphs' gain in this run
            runner.graphs = None
            our_generate(runner, prompts, 3, bps)
            eager = our_generate(runner, prompts, new, bps)
            runner.graphs = graphs
        # warm-up of the whole length: kernels compiled and, with graphs, every step's graph
        # captured (a server captures its decode shapes once; a signature repeats every step).
        # Twice with graphs: a signature is captured at its second sighting, and the prefill's
        # comes once a generate (graphed only under DEEPINFER_CUDA_GRAPH_MAX_TOKENS >= the prompt)
        for _ in range(2 if graphs is not None else 1):
            our_generate(runner, prompts, new, bps)
        before = dataclasses.replace(graphs.stats) if graphs is not None else None
        ours = our_generate(runner, prompts, new, bps)
        row = dict(model="slice", batch=b, prompt=plen, new=new, ours_tok_s=b * new / ours.seconds,
                   ours_decode_tok_s=b * (new - 1) / ours.decode_seconds)  # fmt: skip
        if eager is not None:
            after = graphs.stats
            row.update(eager_tok_s=b * new / eager.seconds, graphs_vs_eager=eager.seconds / ours.seconds,
                       same_as_eager=_same(ours.tokens, eager.tokens), replays=after.replays - before.replays,
                       captures=after.captures - before.captures, graph_failures=after.failed)  # fmt: skip
            report.figure(f"ours_eager_tok_s_b{b}", b * new / eager.seconds)
            report.figure(f"graphs_vs_eager_b{b}", eager.seconds / ours.seconds)
            report.figure(f"graph_replays_b{b}", after.replays - before.replays)
        if not args.skip_engine:  # the serving engine's step loop on the same runner, ids fed or read
            for feed in (True, False):
                engine_generate(runner, prompts, new, feed_ids=feed)  # (its own warm-up: scheduler state)
            fed_run = min((engine_generate(runner, prompts, new, feed_ids=True) for _ in range(2)), key=_secs)
            host_run = min((engine_generate(runner, prompts, new, feed_ids=False) for _ in range(2)), key=_secs)
            row.update(engine_tok_s=b * new / fed_run.seconds, engine_same=_same(fed_run.tokens, ours.tokens))
            report.figure(f"engine_tok_s_b{b}", b * new / fed_run.seconds)
            report.figure(f"engine_decode_tok_s_b{b}", b * (new - 1) / fed_run.decode_seconds)
            report.figure(f"engine_host_ids_tok_s_b{b}", b * new / host_run.seconds)
            report.figure(f"engine_fed_vs_host_ids_b{b}", host_run.seconds / fed_run.seconds)
            report.figure(f"engine_same_as_runner_b{b}", _same(fed_run.tokens, ours.tokens))
        report.figure(f"ours_tok_s_b{b}", b * new / ours.seconds)
        report.figure(f"ours_decode_tok_s_b{b}", b * (new - 1) / ours.decode_seconds)
        if not args.skip_hf:
            hf_s, hf_tokens = hf_generate(ref, prompts, new)
            row.update(hf_tok_s=b * new / hf_s, ours_vs_hf=hf_s / ours.seconds, same=_same(ours.tokens, hf_tokens))
            report.figure(f"hf_tok_s_b{b}", b * new / hf_s)
            report.figure(f"ours_vs_hf_b{b}", hf_s / ours.seconds)
        if b == 1:
            row["vs_roofline"] = b * new / ours.seconds / roofline
            report.figure("ours_vs_roofline_b1", b * new / ours.seconds / roofline)
            report.figure("ours_decode_vs_roofline_b1", (new - 1) / ours.decode_seconds / roofline)
        report.row(**row)
        print(f"  batch {b}: {row}", flush=True)
        if b in (1, 64):
            path = None if profile_dir is None else profile_dir / f"profile_decode_b{b}.txt"
            kernels, copies, device_ms = count_launches(runner, prompts, bps, new, 3, path)
            report.figure(f"launches_per_token_b{b}", kernels)
            report.figure(f"copies_per_token_b{b}", copies)
            report.figure(f"device_ms_per_step_b{b}", device_ms)
            if b == 1:
                report.figure("device_time_vs_roofline_b1", 1e3 / device_ms / roofline)
        if b == 64 and args.profile_prefill:
            path = None if profile_dir is None else profile_dir / f"profile_prefill_b{b}.txt"
            wall_ms, device_ms = profile_prefill(runner, prompts, bps, path)
            report.figure(f"prefill_wall_ms_b{b}", wall_ms)
            report.figure(f"prefill_device_ms_b{b}", device_ms)
            print(f"  batch {b} prefill ({b * plen} tokens): {wall_ms:.1f} ms wall, {device_ms:.1f} ms of kernels",
                  flush=True)
    prompt = _prompts(ref.config.vocab_size, 1, args.prefill_len, 7)[0]
    our_prefill(runner, prompt[:1024], prefill_blocks)  # prefill variants compiled
    ours_s = min(our_prefill(runner, prompt, prefill_blocks) for _ in range(2))
    flops = fl.prefill_flops_per_token * len(prompt)
    report.figure("ours_prefill_8k_s", ours_s)
    report.figure("ours_prefill_8k_vs_matrix_rate", flops / ours_s / (mm_tflops * 1e12))
    if not args.skip_hf:
        hf_prefill(ref, prompt[:1024])
        try:
            hf_s = min(hf_prefill(ref, prompt) for _ in range(2))
        except torch.cuda.OutOfMemoryError:  # transformers' eager attention holds [heads, T, T] scores
            print(f"transformers' {len(prompt)}-token prefill does not fit this card's memory beside ours: "
                  "no prefill ratio in this run", flush=True)
            report.figure("hf_prefill_8k_oom", 1)
            return
        report.figure("hf_prefill_8k_s", hf_s)
        report.figure("ours_vs_hf_prefill_8k", hf_s / ours_s)


def kernels_part(args) -> Report:
    from deepinfer_bench import gpu_micro

    micro = Report("Triton kernels vs their torch form at V4-Flash decode shapes (median us per call)")
    for t in gpu_micro.run():
        micro.row(kernel=t.name, tokens=t.tokens, ours_us=t.ours_us, torch_us=t.torch_us,
                  speedup=t.torch_us / t.ours_us, ours_gbps=t.gbps)  # fmt: skip
    return micro


def main(argv=None) -> int:
    p = base_parser("gpu", __doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--prompt-lens", default="1024,1024,512", help="prompt length per batch size")
    p.add_argument("--new-tokens", default="64,64,32", help="new tokens per batch size")
    p.add_argument("--prefill-len", type=int, default=8192)
    p.add_argument("--tiny-new-tokens", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true", help="ours only (no transformers runs)")
    p.add_argument("--skip-engine", action="store_true",
                   help="no runs through the engine's step loop (EngineCore + pipelined device thread)")
    p.add_argument("--kernels", action="store_true", help="also the kernel microbenchmarks")
    p.add_argument("--parts", default="tiny,slice", help="comma-separated: tiny, slice")
    p.add_argument("--profile-dir", default=None, help="write per-kernel tables of profiled decode steps here")
    p.add_argument("--profile-prefill", action="store_true",
                   help="batch 64: also time and profile the generate's first forward (its whole prompts), "
                        "figures prefill_{wall,device}_ms_b64, table profile_prefill_b64.txt in --profile-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default=None, choices=("fp8",),
                   help="ours with FP8 weights (transformers stays bf16); the roofline counts the bytes as served")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench gpu: skipped (needs a CUDA device)")
        return 0
    weights = "FP8 weights" if args.quantization else "bf16"
    report = Report(f"V4 on {torch.cuda.get_device_name()}: ours ({weights}) vs transformers (bf16), greedy (tokens/s)")
    report.figure("ours_fp8_weights", float(args.quantization == "fp8"))
    copy_gbps, mm_tflops = ceilings()
    report.figure("copy_gbps", copy_gbps)
    report.figure("bf16_matmul_tflops", mm_tflops)
    print(f"ceilings: copy {copy_gbps:.0f} GB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    profile_dir = Path(args.profile_dir) if args.profile_dir else None
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    parts = {"tiny": lambda: tiny_part(report, args.tiny_new_tokens),
             "slice": lambda: slice_part(report, args, copy_gbps, mm_tflops, profile_dir)}  # fmt: skip
    micro = None
    for name in [n for n in args.parts.split(",") if n]:
        try:
            parts[name]()
        except Exception:  # noqa: BLE001 - report the other parts' figures, then fail
            traceback.print_exc()
            failed.append(name)
            report.figure(f"failed_{name}", 1)
    if args.kernels:
        try:
            micro = kernels_part(args)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed.append("kernels")
    if micro is not None:
        print(micro.render(), flush=True)
    report.finish(args.json)
    return 1 if failed else 0
