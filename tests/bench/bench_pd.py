"""``deepinfer bench pd``: disaggregated (1 prefill + 1 decode process) vs co-located serving.

The same requests at the same load (``--concurrency`` streams in flight, ``--num-requests``
in all, random prompts of ``--prompt-len`` tokens, ``--max-tokens`` greedy outputs) go to

- co-located: ``AsyncEngine`` in this process (what ``deepinfer serve`` mounts), and
- disaggregated: ``LocalPdCluster`` (``deepinfer serve --disaggregated``'s engines: separate
  ``deepinfer node`` processes, KV handed over the ipc data plane) through its gateway client;
  the decode engine steps through the pipelined loop (runtime/disagg/engine_loop.py), the
  prefill engine through the serial one.

Measured at the client: TTFT (request sent -> first token) and ITL (gap between later token
deltas, per token), p50/p99. Handoff figures come from the engines' own counters
(``PdEngineStatus``): bytes, latency p50/p99 (export + transfer + import + ack), GB/s of the
bulk transfers, failures by kind. On one loaded CPU host both setups share the same cores, so
the disaggregated TTFT includes the handoff and process hops without any isolation benefit:
read the ratio, not the absolute numbers.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path

from deepinfer_bench.report import Report, base_parser

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.runtime.disagg.handoff_metrics import percentile


def _requests(num: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(prompt_len)] for _ in range(num)]


async def _drive(client, prompts, max_tokens: int, concurrency: int, tag: str) -> dict[str, list[float]]:
    ttft, itl, e2e = [], [], []
    sem = asyncio.Semaphore(concurrency)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> None:
        async with sem:
            t0 = last = time.perf_counter()
            first = None
            async for out in client.generate({"prompt_token_ids": prompt}, params, request_id=f"{tag}-{i}"):
                n = len(out.outputs[0].token_ids)
                if not n:
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                    ttft.append(now - t0)
                    n -= 1
                if n:
                    itl.append((now - last) / n)
                last = now
            e2e.append(time.perf_counter() - t0)

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return {"ttft": ttft, "itl": itl, "e2e": e2e}


async def _colocated(model_dir: Path, options: dict, prompts, args) -> dict[str, list[float]]:
    from deepinfer.engine.api.async_engine import AsyncEngine

    engine = await AsyncEngine.start(model=str(model_dir), **options)
    try:
        await _drive(engine, prompts[: args.concurrency], args.max_tokens, args.concurrency, "warm")
        return await _drive(engine, prompts, args.max_tokens, args.concurrency, "co")
    finally:
        await engine.shutdown()


async def _disaggregated(model_dir: Path, options: dict, prompts, args):
    from deepinfer.runtime.disagg.launch import LocalPdCluster
    from deepinfer.transport.protocol import PdStatusRequest

    async with LocalPdCluster(model_dir, num_prefill=1, num_decode=1, engine_options=options,
                              transport=args.transport) as cluster:
        await _drive(cluster.client, prompts[: args.concurrency], args.max_tokens, args.concurrency, "warm")
        before = await cluster.client.directory.engines["prefill-0"].rpc.request(PdStatusRequest(), timeout_s=10)
        lat = await _drive(cluster.client, prompts, args.max_tokens, args.concurrency, "pd")
        after = await cluster.client.directory.engines["prefill-0"].rpc.request(PdStatusRequest(), timeout_s=10)
        return lat, before, after


def main(argv=None) -> int:
    p = base_parser("pd", __doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: a fresh tiny DeepSeek-V4)")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per engine")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="di-bench-pd-") as tmp:
        model_dir = Path(args.model) if args.model else Path(tmp) / "model"
        if not args.model:
            from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model

            write_tiny_model(model_dir, seed=0)
        options = dict(dtype="float32", block_size=128, max_model_len=2048, num_blocks=16 * args.concurrency,
                       max_num_seqs=max(8, args.concurrency), num_threads=args.num_threads)
        prompts = _requests(args.num_requests, args.prompt_len)
        co = asyncio.run(_colocated(model_dir, options, prompts, args))
        pd, before, after = asyncio.run(_disaggregated(model_dir, options, prompts, args))

    report = Report(f"P/D disaggregation vs co-located: {args.num_requests} requests, {args.prompt_len}-token prompts, "
                    f"{args.max_tokens} tokens, {args.concurrency} in flight ({args.transport})")
    for name, lat in (("colocated", co), ("pd", pd)):
        report.row(setup=name, ttft_p50_ms=1e3 * percentile(lat["ttft"], 0.5), ttft_p99_ms=1e3 * percentile(lat["ttft"], 0.99),
                   itl_p50_ms=1e3 * percentile(lat["itl"], 0.5), itl_p99_ms=1e3 * percentile(lat["itl"], 0.99),
                   e2e_p50_s=percentile(lat["e2e"], 0.5))
        report.figure(f"ttft_p50_ms_{name}", 1e3 * percentile(lat["ttft"], 0.5))
        report.figure(f"ttft_p99_ms_{name}", 1e3 * percentile(lat["ttft"], 0.99))
        report.figure(f"itl_p50_ms_{name}", 1e3 * percentile(lat["itl"], 0.5))
        report.figure(f"itl_p99_ms_{name}", 1e3 * percentile(lat["itl"], 0.99))
    num = after.num_handoffs - before.num_handoffs
    nbytes = after.handoff_bytes - before.handoff_bytes
    report.figure("handoffs", num)
    report.figure("handoff_bytes_per_request", nbytes // max(num, 1))
    report.figure("handoff_GBps", after.handoff_GBps)
    report.figure("handoff_p50_ms", 1e3 * after.handoff_p50_s)
    report.figure("handoff_p99_ms", 1e3 * after.handoff_p99_s)
    report.figure("handoff_failures", sum(after.failures.values()))
    for kind, count in sorted(after.failures.items()):
        report.figure(f"handoff_failures_{kind}", count)
    report.finish(args.json)
    return 0
