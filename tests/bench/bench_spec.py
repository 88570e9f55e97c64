"""``deepinfer bench spec``: DSpark's verify-length policies, in the engine on the trained tiny
model (default) or on a simulated drafter (``--simulated``).

Model-backed (tests/bench/spec_engine.py says how each figure is measured): per concurrency the
engine runs the same greedy requests with no speculation, fixed-5 verification and the
confidence schedule; columns ``ver_*`` / ``acc_*`` / ``tok_s_*`` as below, ``identical`` (every
request's tokens, in every round, equal no speculation's), ``cpu_*`` (tokens per CPU second) and ``draft_s`` (the drafter's seconds in the scheduled run).
Figures: ``mode`` = "engine", at concurrency 60 the issue's keys (``verified_per_step_fixed`` /
``_sched``, ``accepted_len_fixed`` / ``_sched``, ``tok_s_off`` / ``_fixed`` / ``_sched``),
``greedy_identical`` (1 when every request at every concurrency matched), per concurrency
``cC_<figure>_<mode>`` (medians over the interleaved rounds; ``cC_tok_s_spread_<mode>`` the
spread, ``cC_ratio_<a>_<b>`` the median per-round tok/s ratio), ``wall_s``. ``--throughput`` adds
the "throughput" schedule (length_policy.py: no accepted-length floor, drafter gated) as a fourth mode. ``--waves W``: at concurrency C the
engine runs W waves of C requests one after another (prompts 0..C-1, then C..2C-1, ...), so a
figure at concurrency 1 is not one prompt's (its accepted length ranges 1.05-2.86 over the first
16 held-out headers).

Simulated (``--simulated``):

Per concurrency (sequences per rank, default 1, 4, 16, 60, 128), ``deepinfer_bench.spec_sim``
runs four policies on the same random draws: no speculation, fixed-5 verification, the exact
confidence schedule and the production variant (budget sized from confidences two steps old).
Columns:

    ver_*      drafts verified per request per step (fixed: 5.00)
    acc_*      tokens committed per request per step, the target's own token included
               (DeepSpec's "acceptance length"; no speculation: 1.00)
    tok_s_*    committed tokens per second of simulated device time
    policy_us  host wall time of one exact schedule call here (not charged to the device time:
               with asynchronous scheduling it overlaps the device's step)

Where the numbers come from: the drafter's acceptance curve is set so fixed-5 commits DeepSeek's
3.29 tokens per step; the step-time curve is a smooth roofline whose floor and per-token slope are
fitted to DeepSeek's two published operating points at 60 sequences (13,730 tok/s fixed-5,
14,466 tok/s scheduled, with their accepted lengths and a 30 % cut in verified drafts); the knee
(128 tokens) and the drafter's cost (3/40 of a target step over its 5 x R tokens) are
assumptions. The tok/s gain at 60 is therefore partly built into the curve; what the run tests
is whether the scheduler, fed calibrated confidences, finds such an operating point, how much
accepted length it gives up, and how the gain moves with concurrency.

Figures (``--json``): ``mode`` = "simulated"; at concurrency 60 (the issue's keys)
``verified_per_step_fixed`` / ``_sched``, ``accepted_len_fixed`` / ``_sched``, ``tok_s_off`` /
``_fixed`` / ``_sched``; per concurrency C ``cC_<figure>_<policy>`` (``expected_len``: what the schedule expected to commit, a
calibration check against ``accepted_len``);
``step_floor_ms``, ``step_per_token_us``, ``wall_s``.

"""

from __future__ import annotations

import time

from deepinfer_bench.report import Report, base_parser
from deepinfer_bench.spec_sim import POLICIES, AcceptanceModel, StepTimeModel, simulate

from deepinfer_bench import spec_engine

DEFAULT_CONCURRENCY = "1,4,16,60,128"
HEADLINE = 60
SHORT = {"off": "off", "fixed": "fixed", "confidence": "sched", "delayed": "delayed"}


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"deepinfer bench spec: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"deepinfer bench spec: values must be >= 1, got {text!r}")
    return values


def _curve(text: str) -> tuple[float, ...]:
    try:
        curve = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"deepinfer bench spec: --curve wants comma-separated probabilities, got {text!r}") from None
    if not curve or not all(0.0 < p < 1.0 for p in curve):
        raise SystemExit(f"deepinfer bench spec: --curve probabilities must lie strictly between 0 and 1, got {text!r}")
    return curve


def build_parser():
    acc, tm = AcceptanceModel(), StepTimeModel(0.0, 0.0)
    p = base_parser("spec", "DSpark verify-length policies: off / fixed-5 / confidence schedule.")
    p.add_argument("--simulated", action="store_true", help="use the simulated-acceptance drafter instead of the engine")
    p.add_argument("--model", default=None, help="model directory (default: the trained tiny checkpoint in the package)")
    p.add_argument("--max-tokens", type=int, default=64, help="engine run: tokens generated per request (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="engine run: interleaved rounds per concurrency, median "
                   "reported (default %(default)s)")
    p.add_argument("--waves", type=int, default=1,
                   help="engine run: at concurrency C, W waves of C requests one after another, each wave the next C "
                        "prompts (default %(default)s: the first C prompts only)")
    p.add_argument("--throughput", action="store_true",
                   help="engine run: also the 'throughput' schedule (no accepted-length floor, drafter gated)")
    p.add_argument("--num-draft-tokens", type=int, default=5, help="engine run: drafts per step (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="engine run: torch threads (default torch's)")
    p.add_argument("--dtype", default="auto", help="engine run: model dtype (default: float32 on CPU, the "
                   "checkpoint's on a GPU)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="engine run: batch-invariant numerics (the CPU's float32 default; on a GPU, needed for "
                        "speculation's greedy outputs to equal no speculation's bitwise)")
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help="sequences per rank (default %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="steps per concurrency (default max(1000, 20000 / C))")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    p.add_argument("--curve", default=",".join(f"{v:g}" for v in acc.curve),
                   help="mean conditional acceptance per draft position (default %(default)s)")
    p.add_argument("--context-spread", type=float, default=acc.context_spread, help="sd of the per-context logit shift (default %(default)s)")
    p.add_argument("--concentration", type=float, default=acc.concentration, help="Beta concentration of the true acceptance (default %(default)s)")
    p.add_argument("--signals", type=int, default=acc.num_signals, help="confidence head sharpness, 0 = context only (default %(default)s)")
    p.add_argument("--knee", type=float, default=tm.knee, help="verify tokens where compute saturates (default %(default)s)")
    p.add_argument("--draft-fraction", type=float, default=tm.draft_fraction, help="drafter pass / target step (default %(default)s)")
    p.add_argument("--max-verify-tokens", type=int, default=None, help="cap on verify tokens per step (default none)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not args.simulated:
        return run_engine(args)
    if args.steps is not None and args.steps < 3:
        raise SystemExit("deepinfer bench spec: --steps must be >= 3 (the delayed policy needs two steps of history)")
    if args.signals < 0 or args.concentration <= 0 or args.context_spread < 0:
        raise SystemExit("deepinfer bench spec: --signals must be >= 0, --concentration > 0, --context-spread >= 0")
    start = time.perf_counter()
    acceptance = AcceptanceModel(_curve(args.curve), args.context_spread, args.concentration, args.signals)
    timing = StepTimeModel.fit_deepseek(acceptance.num_drafts, knee=args.knee, draft_fraction=args.draft_fraction)
    report = Report(
        f"spec (simulated drafter, D={acceptance.num_drafts}): verified drafts and committed tokens per request "
        f"per step; step time {timing.floor_s * 1e3:.2f} ms floor + {timing.per_token_s * 1e6:.2f} us/token past "
        f"{timing.knee:g} tokens (fitted to DeepSeek's 60-sequence figures)"
    )
    report.figure("mode", "simulated")
    for concurrency in _ints(args.concurrency):
        num_steps = args.steps or max(1000, 20000 // concurrency)
        res = simulate(concurrency, num_steps, acceptance, timing, seed=args.seed + concurrency,
                       max_verify_tokens=args.max_verify_tokens)
        fixed, sched, delayed, off = res["fixed"], res["confidence"], res["delayed"], res["off"]
        report.row(conc=concurrency, steps=num_steps,
                   ver_fixed=fixed.verified_per_step, ver_sched=sched.verified_per_step,
                   ver_delayed=delayed.verified_per_step,
                   acc_fixed=fixed.accepted_len, acc_sched=sched.accepted_len, acc_delayed=delayed.accepted_len,
                   tok_s_off=round(off.tok_s), tok_s_fixed=round(fixed.tok_s), tok_s_sched=round(sched.tok_s),
                   tok_s_delayed=round(delayed.tok_s),
                   sched_vs_fixed=f"{sched.tok_s / fixed.tok_s - 1:+.2%}",
                   delayed_vs_fixed=f"{delayed.tok_s / fixed.tok_s - 1:+.2%}",
                   sched_vs_off=f"{sched.tok_s / off.tok_s:.2f}x", policy_us=round(sched.policy_us))  # fmt: skip
        for name in POLICIES:
            r, short = res[name], SHORT[name]
            if name != "off":  # off verifies nothing and expects exactly 1 token per request
                report.figure(f"c{concurrency}_verified_per_step_{short}", r.verified_per_step)
                report.figure(f"c{concurrency}_expected_len_{short}", r.expected / r.num_requests)
            report.figure(f"c{concurrency}_accepted_len_{short}", r.accepted_len)
            report.figure(f"c{concurrency}_tok_s_{short}", r.tok_s)
        report.figure(f"c{concurrency}_policy_us_sched", sched.policy_us)
        if concurrency == HEADLINE:
            for name, r in (("fixed", fixed), ("sched", sched)):
                report.figure(f"verified_per_step_{name}", r.verified_per_step)
                report.figure(f"accepted_len_{name}", r.accepted_len)
            for name, r in (("off", off), ("fixed", fixed), ("sched", sched)):
                report.figure(f"tok_s_{name}", r.tok_s)
    report.figure("step_floor_ms", timing.floor_s * 1e3)
    report.figure("step_per_token_us", timing.per_token_s * 1e6)
    report.figure("wall_s", time.perf_counter() - start)
    report.finish(args.json)
    return 0


def run_engine(args) -> int:
    from deepinfer.engine.models.deepseek_v41.builtin_checkpoint import builtin_checkpoint

    model_dir = args.model or builtin_checkpoint()
    if model_dir is None:
        raise SystemExit("deepinfer bench spec: no trained tiny checkpoint in this tree; pass --model DIR or --simulated")
    if args.max_tokens < 2 or args.repeats < 1 or args.waves < 1:
        raise SystemExit("deepinfer bench spec: --max-tokens must be >= 2, --repeats and --waves >= 1")
    start = time.perf_counter()
    concurrencies = _ints(args.concurrency)
    prompts = spec_engine.prompts_of(model_dir, max(concurrencies) * args.waves)
    modes = dict(spec_engine.MODES, **(spec_engine.EXTRA_MODES if args.throughput else {}))
    engines = spec_engine.start_engines(model_dir, max(concurrencies), max_model_len=512, num_threads=args.threads,
                                        num_draft_tokens=args.num_draft_tokens, modes=modes, dtype=args.dtype,
                                        batch_invariant=True if args.batch_invariant else None)
    report = Report(f"spec (engine, {model_dir}, D={args.num_draft_tokens}, greedy, {args.max_tokens} tokens per "
                    f"request, {args.waves} wave(s) per concurrency): verified drafts and committed tokens per request per decode step")
    report.figure("mode", "engine")
    all_identical = True
    try:
        spec_engine.warm_up(engines, prompts)
        for c in concurrencies:
            waves = [prompts[i * c:(i + 1) * c] for i in range(args.waves)]
            res, ratio = spec_engine.run_concurrency(engines, waves, args.max_tokens, args.repeats)
            off, fixed, sched = res["off"], res["fixed"], res["sched"]
            identical = off.tokens is not None and all(r.tokens == off.tokens for r in res.values())
            all_identical &= identical
            row = dict(conc=c, ver_fixed=fixed.verified_per_step, ver_sched=sched.verified_per_step,
                       acc_fixed=fixed.accepted_len, acc_sched=sched.accepted_len,
                       tok_s_off=round(off.tok_s, 1), tok_s_fixed=round(fixed.tok_s, 1), tok_s_sched=round(sched.tok_s, 1),
                       spread=" / ".join(f"{res[n].tok_s_spread:.0%}" for n in ("off", "fixed", "sched")),
                       sched_vs_fixed=f"{ratio['sched', 'fixed'] - 1:+.2%}", sched_vs_off=f"{ratio['sched', 'off']:.2f}x",
                       cpu_off=round(off.tok_cpu_s, 1), cpu_fixed=round(fixed.tok_cpu_s, 1), cpu_sched=round(sched.tok_cpu_s, 1),
                       draft_s=round(sched.draft_seconds, 2), identical=int(identical))  # fmt: skip
            if "throughput" in res:
                b = res["throughput"]
                row.update(ver_tput=b.verified_per_step, acc_tput=b.accepted_len, tok_s_tput=round(b.tok_s, 1),
                           tput_vs_fixed=f"{ratio['throughput', 'fixed'] - 1:+.2%}", tput_vs_off=f"{ratio['throughput', 'off']:.2f}x")
            report.row(**row)
            for (a, b), value in ratio.items():
                report.figure(f"c{c}_ratio_{a}_{b}", value)
            for name, r in res.items():
                report.figure(f"c{c}_tok_s_{name}", r.tok_s)
                report.figure(f"c{c}_tok_cpu_s_{name}", r.tok_cpu_s)
                report.figure(f"c{c}_tok_s_spread_{name}", r.tok_s_spread)
                if name != "off":
                    report.figure(f"c{c}_verified_per_step_{name}", r.verified_per_step)
                    report.figure(f"c{c}_accepted_len_{name}", r.accepted_len)
            report.figure(f"c{c}_identical", int(identical))
            if c == HEADLINE:
                for name in ("fixed", "sched"):
                    report.figure(f"verified_per_step_{name}", res[name].verified_per_step)
                    report.figure(f"accepted_len_{name}", res[name].accepted_len)
                for name in ("off", "fixed", "sched"):
                    report.figure(f"tok_s_{name}", res[name].tok_s)
        for name, llm in engines.items():  # on a GPU: how many forwards ran from CUDA graphs
            for key, value in (spec_engine.graph_stats(llm) or {}).items():
                report.figure(f"graph_{key}_{name}", value)
    finally:
        for llm in engines.values():
            llm.shutdown()
    report.figure("greedy_identical", int(all_identical))
    report.figure("wall_s", time.perf_counter() - start)
    report.finish(args.json)
    return 0 if all_identical else 1
