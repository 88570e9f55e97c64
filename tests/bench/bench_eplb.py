"""`deepinfer bench eplb`: our EPLB planner next to DeepSeek's on recorded and synthetic traces.

Every setting replays one routing trace ([steps, layers, experts] token counts) through three
placements driven by the same window and period (``deepinfer_bench.eplb.replay``):

    static     the start-up placement, never re-planned (experts in id order, wrap-around spares)
    baseline   DeepSeek's EPLB (``deepinfer_bench.eplb.baseline``): greedy packing of the window mean
    ours       ``deepinfer.engine.parallel.eplb.plan``: two replica-count rules and count moves,
               LPT (an expert's replicas on different GPUs) + swaps, swaps that balance each step
               of the window and not only its mean, then a smoothed (log-sum-exp) slowest GPU of
               each step, a layer kept when the new plan is no better;
               and the schedule's drift trigger (``EplbConfig.drift_margin``): a plan comes early
               when the window's imbalance under the placement in service has grown by the
               margin (prefill 0.0075, decode 0.02). The baseline keeps DeepSeek's fixed period; ``plans`` (baseline/ours)
               counts the re-placements each made

    ours_least_loaded   ours' placements with the EP layer's least-loaded dispatch instead of
               the even split (``deepinfer_bench.eplb.dispatch_sim``; one dispatcher per step, the
               bound of what per-home-rank dispatch reaches; prefill sizes, EP <= 8)

Realised imbalance: each step waits for its slowest GPU at every MoE layer, so a stretch of
steps scores ``sum over steps and layers of the max GPU load / sum of the mean GPU load`` (1.0 is
perfect). A replica carries its expert's tokens over its replica count (even split), for all
three. Figures start at the first plan (step ``window``); the "per period" column gives each
period between plans.

Settings (ARCHITECTURE.md, "Balancers": prefill 4 spare experts per GPU, 100-step window, re-placed every
1000 steps; decode 1 spare per GPU, 1000-step window, every 10,000 steps):

    synthetic prefill-ep2 / prefill-ep4 / decode-ep64: ``deepinfer_bench.eplb.synthetic`` traces
        (drifting Zipf-like topic mix, bursts, per-request skew) at V4-Flash width, 256 experts
        top-6, ``--layers`` layers; each prefill setting has its own trace (2 or 4 DP ranks)
    tiny prefill-ep2 / prefill-ep4 / decode-ep16: traces recorded from the tiny V4 model
        (``deepinfer_bench.eplb.tiny_trace``): 16 experts top-4, 4 layers, random weights. Its CPU
        steps are slow, so a trace has a few hundred steps: one plan, after a window of 50 steps
        (prefill, ~40 prompts; a 10-step window holds too few prompts to say anything about the
        next ones) or 100 steps (decode), serving the rest of the trace; EP stops at 16 GPUs
        (one expert owned per GPU)

``--traces steps`` (not in the default set) runs a real 2-rank EP group on the tiny V4 and reports
step times around its re-placements (``deepinfer_bench.eplb.replacement_steps``: ``steps_*``),
next to a control run of the same group with no re-placement over the same steps (``--steps-rounds``
pairs, alternated): on a shared machine the longest of a dozen steps is mostly the machine's noise.

``--trace PATH.npy`` replays your own float array [steps, layers, experts] instead, with
``--gpus --redundant-per-gpu --window --period [--nodes]``. Size: ``--traces``, ``--layers``,
``--experts``, ``--prefill-periods``, ``--decode-periods``, ``--decode-gpus``, ``--tiny-*-steps``
(the default run takes about a minute on two idle cores, most of it recording the tiny traces).

Figures (``--json``): ``realised_imbalance`` (ours) and ``baseline_imbalance``, the worst over
the settings run (the only setting with --trace); ``wins`` (settings where ours is below the
baseline) of ``settings``; per setting ``<trace>_<setting>_{ours,baseline,static}`` (and ``_ours_least_loaded`` for EP <= 8) and
``..._{ours,baseline}_worst_period``, ``..._{ours,baseline}_plans``; ``plan_ms_{ours,baseline}`` (mean per plan); ``wall_s``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from deepinfer.engine.parallel.eplb import DECODE, PREFILL, EplbConfig, plan
from deepinfer_bench.eplb.baseline import deepseek_plan
from deepinfer_bench.eplb.replay import replay
from deepinfer_bench.eplb.synthetic import SyntheticTrace, decode_config, prefill_config
from deepinfer_bench.report import Report, base_parser

STEPS_DUTY = 0.25  # --traces steps: the staging thread's share of wall time (EpSettings.background_duty)

POLICIES = {"static": None, "baseline": deepseek_plan, "ours": plan}
MAX_DISPATCH_GPUS = 8  # the least-loaded dispatch is replayed in Python, step by step: prefill sizes only
TINY_PREFILL = dict(redundant_per_gpu=4, window=50, period=500)
TINY_DECODE = dict(redundant_per_gpu=1, window=100, period=1000)


@dataclass(frozen=True, slots=True)
class Setting:
    trace: str  # "synthetic" | "tiny" | "file"
    name: str
    config: EplbConfig

    @property
    def key(self) -> str:
        return f"{self.trace}_{self.name}".replace("-", "_")


def build_parser():
    p = base_parser("eplb", "Our EPLB planner vs DeepSeek's on recorded and synthetic routing traces.")
    p.add_argument("--traces", default="synthetic,tiny", help="which traces: synthetic, tiny (default: %(default)s)")
    for flag, default, text in (
        ("--layers", 4, "synthetic: MoE layers"),
        ("--experts", 256, "synthetic: logical experts"),
        ("--top-k", 6, "synthetic: experts per token"),
        ("--prefill-periods", 3, "synthetic: prefill periods measured"),
        ("--decode-periods", 2, "synthetic: decode periods measured"),
        ("--decode-gpus", 64, "synthetic: decode EP size"),
        ("--tiny-prefill-steps", 150, "tiny: prefill steps recorded"),
        ("--tiny-decode-steps", 300, "tiny: decode steps recorded"),
        ("--steps-decode", 240, "steps: decode steps of the EP group run"),
        ("--steps-rounds", 2, "steps: pairs of runs (re-placing, control without re-placement)"),
        ("--seed", 0, "trace seed"),
    ):
        p.add_argument(flag, type=int, default=default, help=f"{text} (default %(default)s)")
    p.add_argument("--steps-duty", type=float, default=STEPS_DUTY,
                   help="steps: share of wall time the staging thread works (EpSettings.background_duty; "
                        "default %(default)s)")
    p.add_argument("--steps-records", metavar="PATH.json", default=None,
                   help="steps: write the raw per-step records there (rank 0 at the top, rank 1 under \"rank1\": step start times, swaps, background phases)")
    p.add_argument("--steps-default-gc", action="store_true",
                   help="steps: leave the cyclic GC as it is (default: the model frozen out of it, "
                        "tune_interpreter(freeze_gc=True))")
    p.add_argument("--trace", metavar="PATH.npy", default=None, help="replay this [steps, layers, experts] array")
    p.add_argument("--gpus", type=int, default=None, help="--trace: EP size")
    p.add_argument("--redundant-per-gpu", type=int, default=None, help="--trace: spare expert slots per GPU")
    p.add_argument("--window", type=int, default=None, help="--trace: steps of statistics per plan")
    p.add_argument("--period", type=int, default=None, help="--trace: steps between plans")
    p.add_argument("--nodes", type=int, default=1, help="--trace: nodes the GPUs sit on (default %(default)s)")
    return p


class BenchError(ValueError):
    """A bad option or trace; the message says which."""


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    report = Report("eplb: realised imbalance (slowest GPU / mean, summed over layers and steps); 1.0 is perfect")
    try:
        results = [_measure(report, *run) for run in _runs(args)]
    except BenchError as exc:
        print(f"deepinfer bench eplb: {exc}")
        return 2
    if "steps" in [t.strip() for t in args.traces.split(",")] and args.trace is None:
        _measure_steps(report, args)
    if not results:
        report.figure("wall_s", time.perf_counter() - start)
        report.finish(args.json)
        return 0
    ours, baseline = [r[0] for r in results], [r[1] for r in results]
    report.figure("realised_imbalance", max(ours))
    report.figure("baseline_imbalance", max(baseline))
    report.figure("wins", sum(o < b for o, b in zip(ours, baseline)))
    report.figure("settings", len(results))
    for i, name in enumerate(("ours", "baseline")):
        seconds, plans = sum(r[2][i] for r in results), sum(r[3][i] for r in results)
        report.figure(f"plan_ms_{name}", 1000.0 * seconds / max(plans, 1))
    report.figure("wall_s", time.perf_counter() - start)
    report.finish(args.json)
    return 0


def _measure(report: Report, setting: Setting, chunks, num_layers: int, num_experts: int):
    """Replay one setting, add its row and figures; (ours, baseline, plan seconds, plans)."""
    cfg = setting.config
    configs = {"baseline": dataclasses.replace(cfg, drift_margin=0.0)}  # DeepSeek's fixed period
    dispatch = ("ours",) if cfg.num_gpus <= MAX_DISPATCH_GPUS else ()
    series = replay(chunks, cfg, POLICIES, num_layers, num_experts, configs, dispatch)
    num_steps = sum(len(c) for c in series["ours"].peak)
    if num_steps <= cfg.window:
        raise BenchError(f"{setting.key}: {num_steps} steps do not pass the window of {cfg.window}")
    bounds = list(range(cfg.window, num_steps, cfg.period)) + [num_steps]
    value = {name: s.imbalance(cfg.window) for name, s in series.items()}
    least = series["ours"].imbalance(cfg.window, dispatch=True) if dispatch else None
    per_period = {name: [s.imbalance(a, b) for a, b in zip(bounds, bounds[1:])] for name, s in series.items()}
    report.row(trace=setting.trace, setting=setting.name, gpus=cfg.num_gpus,
               slots_per_gpu=cfg.num_physical(num_experts) // cfg.num_gpus, layers=num_layers,
               measured_steps=num_steps - cfg.window, static=value["static"], baseline=value["baseline"],
               ours=value["ours"], plans=f"{series['baseline'].num_plans}/{series['ours'].num_plans}",
               ours_least_loaded="" if least is None else f"{least:.3f}",
               ours_per_period=" ".join(f"{v:.3f}" for v in per_period["ours"]),
               baseline_per_period=" ".join(f"{v:.3f}" for v in per_period["baseline"]))  # fmt: skip
    for name in ("ours", "baseline", "static"):
        report.figure(f"{setting.key}_{name}", value[name])
    if least is not None:
        report.figure(f"{setting.key}_ours_least_loaded", least)
    for name in ("ours", "baseline"):
        report.figure(f"{setting.key}_{name}_worst_period", max(per_period[name]))
        report.figure(f"{setting.key}_{name}_plans", series[name].num_plans)
    names = ("ours", "baseline")
    return (value["ours"], value["baseline"], [series[n].plan_seconds for n in names],
            [series[n].num_plans for n in names])


def _measure_steps(report: Report, args) -> None:
    """``--traces steps``: step times around re-placements in a real 2-rank EP group."""
    from deepinfer_bench.eplb.replacement_steps import measure

    if not 0 < args.steps_duty <= 1:
        raise BenchError(f"--steps-duty {args.steps_duty}: give a share in (0, 1]")
    for name, value in measure(steps=args.steps_decode, rounds=args.steps_rounds, duty=args.steps_duty,
                               freeze_gc=not args.steps_default_gc, records_path=args.steps_records).items():
        report.figure(f"steps_{name}", value)


def _runs(args):
    """(setting, chunks, num_layers, num_experts) per setting; chunks may be a lazy iterator."""
    if args.trace is not None:
        yield _file_run(args)
        return
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    unknown = sorted(set(traces) - {"synthetic", "tiny", "steps"})
    if unknown or not traces:
        raise BenchError(f"--traces {args.traces!r}: choose from synthetic, tiny, steps")
    if min(args.layers, args.experts, args.top_k, args.prefill_periods, args.decode_periods) < 1:
        raise BenchError("--layers, --experts, --top-k and the period counts must be at least 1")
    if "synthetic" in traces:
        yield from _synthetic_runs(args)
    if "tiny" in traces:
        yield from _tiny_runs(args)


def _synthetic_runs(args):
    experts = args.experts
    for gpus in (2, 4):
        cfg = EplbConfig(num_gpus=gpus, **PREFILL)
        _check_split(experts, gpus)
        steps = cfg.window + args.prefill_periods * cfg.period
        trace = SyntheticTrace(prefill_config(steps, gpus, num_layers=args.layers, num_experts=experts,
                                              top_k=args.top_k, seed=args.seed))
        yield Setting("synthetic", f"prefill-ep{gpus}", cfg), trace.chunks(), args.layers, experts
    cfg = EplbConfig(num_gpus=args.decode_gpus, **DECODE)
    _check_split(experts, args.decode_gpus)
    steps = cfg.window + args.decode_periods * cfg.period
    trace = SyntheticTrace(decode_config(steps, args.decode_gpus, num_layers=args.layers, num_experts=experts,
                                         top_k=args.top_k, seed=args.seed))
    yield Setting("synthetic", f"decode-ep{args.decode_gpus}", cfg), trace.chunks(), args.layers, experts


def _tiny_runs(args):
    from deepinfer_bench.eplb.tiny_trace import record

    if args.tiny_prefill_steps <= TINY_PREFILL["window"] or args.tiny_decode_steps <= TINY_DECODE["window"]:
        raise BenchError(f"--tiny-prefill-steps must exceed {TINY_PREFILL['window']} and --tiny-decode-steps "
                         f"{TINY_DECODE['window']} (the windows)")
    prefill, decode = record(args.tiny_prefill_steps, args.tiny_decode_steps, seed=args.seed)
    layers, experts = prefill.shape[1:]
    for gpus in (2, 4):
        setting = Setting("tiny", f"prefill-ep{gpus}", EplbConfig(num_gpus=gpus, **TINY_PREFILL))
        yield setting, [prefill], layers, experts
    yield Setting("tiny", f"decode-ep{experts}", EplbConfig(num_gpus=experts, **TINY_DECODE)), [decode], layers, experts


def _file_run(args):
    missing = [f"--{n.replace('_', '-')}" for n in ("gpus", "redundant_per_gpu", "window", "period")
               if getattr(args, n) is None]
    if missing:
        raise BenchError(f"--trace needs {', '.join(missing)}")
    try:
        trace = np.load(args.trace, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read {args.trace} as a .npy array: {exc}") from None
    if trace.ndim != 3 or not np.issubdtype(trace.dtype, np.number):
        raise BenchError(f"{args.trace}: want a numeric array [steps, layers, experts], "
                         f"got {trace.dtype} {trace.shape}")
    steps, layers, experts = trace.shape
    cfg = EplbConfig(num_gpus=args.gpus, redundant_per_gpu=args.redundant_per_gpu, window=args.window,
                     period=args.period, num_nodes=args.nodes)
    try:
        cfg.validate(experts)
    except ValueError as exc:
        raise BenchError(f"{args.trace}: {exc}") from None
    if steps <= args.window:
        raise BenchError(f"{args.trace}: {steps} steps are not more than the window ({args.window}); "
                         "nothing to measure")
    return Setting("file", f"ep{args.gpus}", cfg), _checked_chunks(args.trace, trace), layers, experts


def _checked_chunks(path: str, trace: np.ndarray, chunk_steps: int = 1000):
    """The memory-mapped trace in chunks of steps, each checked before it is replayed."""
    for first in range(0, trace.shape[0], chunk_steps):
        chunk = np.asarray(trace[first : first + chunk_steps], dtype=np.float64)
        if not (np.isfinite(chunk).all() and (chunk >= 0).all()):
            raise BenchError(f"{path}: token counts must be finite and non-negative (steps {first} onwards)")
        yield chunk


def _check_split(experts: int, gpus: int) -> None:
    if experts % gpus:
        raise BenchError(f"{experts} experts do not split over {gpus} GPUs; choose --experts as a multiple")
