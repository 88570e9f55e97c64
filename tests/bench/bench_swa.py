"""``deepinfer bench swa``: rebuilding the SWA state of a prefix hit, exact vs bounded replay.

Cost: for hit lengths 1K..32K, one replay forward on the built-in tiny model (8 layers, window
128, block cache of the whole hit in place) replays the last ``window * layers`` = 1024 tokens
(exact) or the last ``--replay-tokens`` (bounded, default 128) with windows truncated to the
replayed segment and the block cache read only. Reported per request: replayed tokens, the
FLOP estimate (engine/kv/swa_replay.py FlopModel) and the median wall time of ``--reps`` runs.
Exact grows with the hit until it reaches ``window * layers`` tokens (then only its compressed-
attention term grows); bounded stays flat.

Continuation (``--continuation-hit``, 0 skips it): a 2-turn conversation through ``AsyncEngine``
(engine options as ``deepinfer serve`` sets them) whose second turn hits the first turn's
blocks; the second turn's time to first token with the slot restored (``swa_store_slots``),
with exact replay and with bounded replay (no store), median of ``--reps`` conversations.

Quality: for ``--num-prompts`` random prompts of ``--quality-hit`` + 16 tokens, the exact state
(a full prefill, what exact replay and a slot restore give) generates 64 greedy tokens; the
bounded state (replay of the last 128 hit tokens over the same block cache) is fed the same
tokens. Per position: top-1 agreement and KL(exact || bounded) of the next-token distributions.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
from deepinfer_bench.report import Report, base_parser

from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.kv.swa_replay import DEFAULT_REPLAY_TOKENS, exact_replay_tokens, flop_model
from deepinfer.engine.models.deepseek_v4.tiny_model import init_weights, tiny_config

BLOCK = 128


def _runner(max_tokens: int, num_slots: int = 2) -> ModelRunner:
    cfg = tiny_config()
    cfg = replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_tokens + 256))
    num_blocks = 2 * (max_tokens // BLOCK + 4)
    return ModelRunner(cfg, init_weights(tiny_config(), seed=0), num_blocks=num_blocks, num_slots=num_slots,
                       block_size=BLOCK, batch_invariant=False)


def _replay_step(hit: int, num_replay: int, table: list[int], vocab: int, g: torch.Generator) -> SeqStep:
    ids = torch.randint(3, vocab, (num_replay,), generator=g).tolist()
    start = hit - num_replay
    return SeqStep(0, 0, table, start, ids, 1, window_start=start, write_from=hit)


def bench_cost(report: Report, hits: list[int], replay_tokens: int, reps: int) -> dict[int, tuple[float, float, float]]:
    """hit -> (exact wall s, bounded wall s, exact/bounded FLOP ratio)."""
    runner = _runner(max(hits))
    cfg = runner.config
    fm = flop_model(cfg)
    num_exact = exact_replay_tokens(cfg.sliding_window, cfg.num_hidden_layers)
    table = list(range(max(hits) // BLOCK + 1))
    g = torch.Generator().manual_seed(0)
    walls: dict[int, tuple[float, float, float]] = {}
    runner.execute(ForwardBatch([_replay_step(hits[0], min(hits[0], replay_tokens), table, cfg.vocab_size, g)]))  # warm-up
    for hit in hits:
        row = {}
        for mode, cap in (("exact", num_exact), ("bounded", replay_tokens)):
            n = min(hit, cap)
            times = []
            for _ in range(reps):
                step = _replay_step(hit, n, table[: hit // BLOCK + 1], cfg.vocab_size, g)
                t0 = time.perf_counter()
                runner.execute(ForwardBatch([step]))
                times.append(time.perf_counter() - t0)
            row[mode] = (n, fm.replay_flops(hit, n), statistics.median(times))
        walls[hit] = (row["exact"][2], row["bounded"][2], row["exact"][1] / row["bounded"][1])
        report.row(hit=hit, exact_tokens=row["exact"][0], exact_gflop=row["exact"][1] / 1e9,
                   exact_ms=row["exact"][2] * 1e3, bounded_tokens=row["bounded"][0],
                   bounded_gflop=row["bounded"][1] / 1e9, bounded_ms=row["bounded"][2] * 1e3,
                   wall_ratio=row["exact"][2] / row["bounded"][2], flop_ratio=row["exact"][1] / row["bounded"][1])
    return walls


def _decode_logits(runner: ModelRunner, slot: int, table: list[int], pos: int, tok: int, ws: int, wf: int) -> torch.Tensor:
    return runner.execute(ForwardBatch([SeqStep(slot, slot, table, pos, [tok], 1, ws, wf)]))[0]


def bench_quality(hit: int, num_prompts: int, num_generated: int, replay_tokens: int) -> tuple[float, float]:
    tail = 16
    total = hit + tail + num_generated
    runner = _runner(total)
    cfg = runner.config
    blocks_per_seq = total // BLOCK + 2
    agree, kls = [], []
    for p in range(num_prompts):
        g = torch.Generator().manual_seed(100 + p)
        prompt = torch.randint(3, cfg.vocab_size, (hit + tail,), generator=g).tolist()
        exact_table = list(range(blocks_per_seq))
        # bounded shares the hit blocks read-only (write_from = hit) and owns the rest
        bounded_table = exact_table[: hit // BLOCK] + list(range(blocks_per_seq, blocks_per_seq + blocks_per_seq - hit // BLOCK))
        # exact: full prefill in chunks
        logits = None
        for s in range(0, len(prompt), 512):
            chunk = prompt[s : s + 512]
            last = s + len(chunk) == len(prompt)
            out = runner.execute(ForwardBatch([SeqStep(0, 0, exact_table, s, chunk, 1 if last else 0)]))
            logits = out[0] if last else logits
        exact_logits, generated = [logits], []
        for i in range(num_generated - 1):
            tok = int(exact_logits[-1].argmax())
            generated.append(tok)
            exact_logits.append(_decode_logits(runner, 0, exact_table, len(prompt) + i, tok, 0, 0))
        # bounded: replay the last replay_tokens of the hit plus the prompt tail, then the same tokens
        start = hit - min(hit, replay_tokens)
        step = SeqStep(1, 1, bounded_table, start, prompt[start:], 1, window_start=start, write_from=hit)
        bounded_logits = [runner.execute(ForwardBatch([step]))[0]]
        for i, tok in enumerate(generated):
            bounded_logits.append(_decode_logits(runner, 1, bounded_table, len(prompt) + i, tok, start, hit))
        for le, lb in zip(exact_logits, bounded_logits):
            agree.append(float(le.argmax() == lb.argmax()))
            pe, lpb = le.float().log_softmax(-1), lb.float().log_softmax(-1)
            kls.append(float((pe.exp() * (pe - lpb)).sum()))
    return sum(agree) / len(agree), sum(kls) / len(kls)


async def _continuation_ttft(model_dir: str, hit: int, reps: int, **options) -> tuple[float, int]:
    """(median second-turn TTFT in s, slots restored) of ``reps`` conversations whose second turn
    hits ``hit`` tokens."""
    from deepinfer.engine.api.async_engine import AsyncEngine
    from deepinfer.engine.api.sampling_params import SamplingParams

    engine = await AsyncEngine.start(model=model_dir, dtype="float32", device="cpu", max_model_len=hit + 512,
                                     max_num_seqs=2, block_size=BLOCK, **options)
    g = torch.Generator().manual_seed(1)
    times = []
    try:
        for rep in range(reps + 1):  # the first conversation warms the engine up
            # the prompt ends 2 past the hit boundary: the first turn's state there is snapshotted
            turn1 = torch.randint(3, 4000, (hit + 2,), generator=g).tolist()
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            out1 = []
            async for d in engine.generate({"prompt_token_ids": turn1}, params, request_id=f"a{rep}"):
                out1 += d.outputs[0].token_ids
            turn2 = turn1 + out1 + torch.randint(3, 4000, (32,), generator=g).tolist()
            t0 = time.perf_counter()
            async for _ in engine.generate({"prompt_token_ids": turn2}, params, request_id=f"b{rep}"):
                if rep:
                    times.append(time.perf_counter() - t0)
                break  # leaving early aborts the rest
        num_restored = engine.swa_slots.stats.num_restored if engine.swa_slots is not None else 0
    finally:
        await engine.shutdown()
    return statistics.median(times), num_restored


def bench_continuation(report: Report, hit: int, reps: int) -> None:
    import asyncio
    import tempfile

    from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-swa-") as model_dir:
        write_tiny_model(model_dir, seed=0)
        for name, options in (("restored", dict(swa_store_slots=4)),
                              ("exact", dict(swa_replay="exact", swa_store_slots=0)),
                              ("bounded", dict(swa_replay="bounded", swa_store_slots=0))):
            ttft, num_restored = asyncio.run(_continuation_ttft(model_dir, hit, reps, **options))
            if (name == "restored") != (num_restored > 0) or (name == "restored" and num_restored < reps + 1):
                raise RuntimeError(f"{name}: the continuations restored {num_restored} slots in {reps + 1} conversations")
            report.figure(f"continuation_ttft_ms_{name}", ttft * 1e3)
        report.figure("continuation_hit_tokens", hit)


def main(argv: list[str] | None = None) -> int:
    p = base_parser("swa", __doc__.splitlines()[0])
    p.add_argument("--hits", default="1024,2048,4096,8192,16384,32768", help="prefix-hit lengths (multiples of 128)")
    p.add_argument("--replay-tokens", type=int, default=DEFAULT_REPLAY_TOKENS)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quality-hit", type=int, default=2048)
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--num-generated", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--continuation-hit", type=int, default=2048,
                   help="second-turn prefix hit of the AsyncEngine continuation (multiple of 128; 0: skip)")
    p.add_argument("--quick", action="store_true", help="hits 256,1024; 1 prompt of 256+16 tokens, 8 generated (a smoke run)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hits = [int(h) for h in args.hits.split(",")]
    if args.quick:
        hits, args.reps, args.num_prompts, args.num_generated, args.quality_hit = [256, 1024], 1, 1, 8, 256
        args.continuation_hit = min(args.continuation_hit, 512)
    bad = [h for h in hits if h <= 0 or h % BLOCK]
    if bad:
        p.error(f"--hits: {bad[0]} is not a positive multiple of {BLOCK}")
    if args.continuation_hit < 0 or args.continuation_hit % BLOCK:
        p.error(f"--continuation-hit: {args.continuation_hit} is not 0 or a positive multiple of {BLOCK}")
    report = Report(f"SWA rebuild per request, tiny V4 (8 layers, window 128): exact vs bounded ({args.replay_tokens} tokens)")
    with torch.inference_mode():
        walls = bench_cost(report, hits, args.replay_tokens, args.reps)
        top1, kl = bench_quality(args.quality_hit, args.num_prompts, args.num_generated, args.replay_tokens)
        # control: the same path replaying the whole hit must reproduce the exact state
        control_top1, control_kl = bench_quality(args.quality_hit, 1, min(args.num_generated, 8), args.quality_hit)
    if args.continuation_hit:
        bench_continuation(report, args.continuation_hit, args.reps)
    longest = max(hits)
    report.figure(f"exact_vs_bounded_cost_ratio_{longest // 1024}k", walls[longest][0] / walls[longest][1])  # wall time
    report.figure(f"exact_vs_bounded_flop_ratio_{longest // 1024}k", walls[longest][2])
    report.figure("bounded_ms_spread", (max(w[1] for w in walls.values()) - min(w[1] for w in walls.values())) * 1e3)
    report.figure("bounded_top1_agreement", top1)
    report.figure("bounded_mean_kl", kl)
    report.figure("control_full_replay_top1", control_top1)
    report.figure("control_full_replay_kl", control_kl)
    report.figure("quality_hit_tokens", args.quality_hit)
    report.figure("quality_generated_tokens", args.num_generated)
    report.finish(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
