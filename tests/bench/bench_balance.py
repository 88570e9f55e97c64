"""`deepinfer bench balance`: the balancers against baselines on one simulated cluster trace.

A discrete-event simulator (``deepinfer_bench.sim``) replays one trace through 16 prefill ranks,
one 16-rank lockstep decode group and 4 vision encoders, routed by 4 gateways, once per policy,
and reports TTFT, ITL, throughput, prefix-cache hit rate and decode balance efficiency (defined
in ``deepinfer_bench.sim.metrics``). Policies, all from ``deepinfer.runtime.balance``:

    round-robin          round-robin prefill, decode and VE
    least-requests       fewest outstanding requests (prefill, decode); round-robin VE
    sglang-cache-aware   SGLang router's approximate-tree policy (prefill); least-requests decode
    affinity-only        longest cached prefix from cache events, load ignored; least-requests decode
    ours                 tiered prefill router, two-dimensional decode balancer, VE balancer

Extra policies for ablation (``--policies``): ``ours-no-tiers`` (one tier), ``ours-prefill+lr-decode``.

The default workload and why it is realistic
--------------------------------------------
Traffic is a mix of chatbot sessions and coding-agent sessions, as a frontier-model API serves.

* Sessions, not independent requests: a turn's prompt is the previous prompt + reply + new
  tokens, so most prompt tokens were seen before (94 % of them with ideal reuse in this trace;
  ARCHITECTURE.md, "KV store": prefix reuse is where most savings are) and routing decides how many hit.
* Chat (85 % of sessions): one of 200 system prompts (median 1.5K tokens, Zipf-popular, as
  deployments share a few templates), a first message of median 400 tokens, and in 4 % of sessions
  an attached document, log-normal (median 24K, sigma 1.4) capped at the 1M-token context: the
  heavy tail that puts ~1 in 250 chat prompts above 256K. 3.5 turns on average, a user reads for a
  median 25 s between turns, replies median 600 tokens (reasoning model, log-normal), 10 % of
  turns carry 1-4 images of 256-1024 vision tokens.
* Agents (15 % of sessions, but about half of the turns and two thirds of the prefill compute):
  one of 8 scaffolds (instructions + tool schemas, median 12K), a task context of median 4K, then
  25 turns on average of tool results (median 1.5K tokens, heavy-tailed: file reads) with 3 s of
  tool time between turns and short replies (median 350 tokens): contexts grow to ~85K median and
  up to ~600K, the long-context growth that makes tiers and affinity interact. Over all turns,
  55 % of prompts are past 16K tokens, 29 % past 64K and 2.6 % past 256K.
* Arrivals: session starts follow a Markov-modulated Poisson process, 1.5x the mean rate for 20 %
  of the time in bursts of ~20 s: production traffic is bursty at minute scale.
* Load: the session rate is solved so that the prefill compute the trace needs *with ideal prefix
  reuse* is 80 % of the prefill pool (a fleet is sized for the router it runs); decode slots per
  rank are sized for 80 % mean occupancy and VE speed for 70 % utilisation. A policy that loses
  reuse (round-robin) therefore runs the same pool past saturation, as it would in production.
* Engines: one H200 rank each, DeepSeek-V4.1-Flash cost model (``runtime.balance.cost_model``):
  ~16K new tokens/s per prefill rank, quadratic attention; decode step ~10 ms at ~20 requests
  per rank. Prefix cache: ~90M tokens of HBM per prefill rank, LRU; the storage cluster is not
  modelled, so a local miss is recomputed (the cost affinity avoids).
* Gateways: 4 replicas (tokenising and compiling grammars for ~40 requests/s of up to 1M tokens
  is more than one Python process does), each session pinned to one, each routing on 100 ms
  load heartbeats plus its own routed work (``runtime.balance.load_view``) and all sharing the
  engines' cache events and one tier plan. ``--gateways 1 --heartbeat 0`` gives one gateway with
  exact live loads instead: the most any router can know.
* 8 minutes of traffic, the first 2 excluded from figures (caches and agent sessions warm up).
  Later turns are sent when the previous reply is complete, so a policy that falls behind also
  serves fewer turns in the window; hit rates against affinity-only are therefore compared over
  the turns both served (``same_turn_hit_rates``).

Figures (``--json``): ``decode_balance_efficiency`` (ours), ``ttft_p99_ratio_rr_over_ours``,
``hit_rate_gap_vs_affinity_points`` (best affinity-only hit rate minus ours, in points), and per
policy ``<policy>_<metric>`` for every column of the table.
"""

from __future__ import annotations

import time
from dataclasses import replace

from deepinfer_bench.report import Report, base_parser
from deepinfer_bench.sim.cluster import ClusterConfig
from deepinfer_bench.sim.metrics import same_turn_hit_rates
from deepinfer_bench.sim.policies import DEFAULT_POLICIES, OURS, build_policy, is_affinity_only
from deepinfer_bench.sim.runner import run_policies
from deepinfer_bench.sim.workload import WorkloadConfig

COLUMNS = (
    ("ttft_p50_s", "ttft_p50_s"),
    ("ttft_p99_s", "ttft_p99_s"),
    ("ttft_short_p99_s", "ttft<16K_p99_s"),
    ("itl_p50_ms", "itl_p50_ms"),
    ("itl_p99_ms", "itl_p99_ms"),
    ("throughput_tok_s", "tok/s"),
    ("hit_rate", "hit_rate"),
    ("decode_balance_efficiency", "decode_eff"),
    ("prefill_utilization", "prefill_util"),
    ("decode_occupancy", "decode_occ"),
    ("ve_wait_p99_s", "ve_wait_p99_s"),
)


def build_parser():
    p = base_parser("balance", "Balancers vs baselines on one simulated cluster trace (deterministic for a seed).")
    w, c = WorkloadConfig(), ClusterConfig()
    p.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated policies (default: %(default)s; extra: ours-no-tiers, ours-prefill+lr-decode)")
    p.add_argument("--duration", type=float, default=w.duration_s, help="seconds of traffic (default %(default)s)")
    p.add_argument("--warmup", type=float, default=w.warmup_s, help="seconds excluded from figures (default %(default)s)")
    p.add_argument("--load", type=float, default=w.prefill_load, help="ideal-reuse prefill load (default %(default)s)")
    p.add_argument("--agent-share", type=float, default=w.agent_session_share,
                   help="fraction of sessions that are agents (default %(default)s)")
    p.add_argument("--prefill", type=int, default=c.num_prefill, help="prefill ranks (default %(default)s)")
    p.add_argument("--decode", type=int, default=c.num_decode, help="decode ranks (default %(default)s)")
    p.add_argument("--cache-tokens", type=int, default=c.prefill_cache_tokens,
                   help="prefix-cache capacity per prefill rank in tokens (default %(default)s)")
    p.add_argument("--gateways", type=int, default=c.num_gateways, help="gateway replicas (default %(default)s)")
    p.add_argument("--heartbeat", type=float, default=c.heartbeat_s,
                   help="seconds between engine load reports; 0: one gateway reads live loads (default %(default)s)")
    p.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per CPU)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    try:
        workload = replace(WorkloadConfig(), duration_s=args.duration, warmup_s=args.warmup, prefill_load=args.load,
                           agent_session_share=args.agent_share)
        cluster = replace(ClusterConfig(), num_prefill=args.prefill, num_decode=args.decode,
                          num_gateways=args.gateways, heartbeat_s=args.heartbeat, prefill_cache_tokens=args.cache_tokens)
        for name in names:
            build_policy(name, cluster.prefill_cost, cluster.decode_cost, 1)
    except ValueError as exc:
        print(f"deepinfer bench balance: {exc}")
        return 2
    start = time.perf_counter()
    summary, results = run_policies(workload, cluster, args.seed, names, args.jobs)
    report = Report(
        f"balance: seed {args.seed}, {args.prefill} prefill + {args.decode} decode ranks, "
        f"{summary.num_sessions} sessions ({summary.num_agent_sessions} agent), "
        f"ideal prefill load {summary.ideal_prefill_load:.2f}, {summary.decode_max_requests} decode slots/rank, "
        + (f"{args.gateways} gateways on {args.heartbeat:g} s heartbeats" if args.heartbeat > 0 else "1 gateway, live loads")
    )
    by_name = {r.name: r for r in results}
    ours = by_name.get(OURS)
    for r in results:
        cells = {label: getattr(r, key) for key, label in COLUMNS}
        report.row(policy=r.name, requests=r.num_requests, **cells)
        prefix = r.name.replace("-", "_").replace("+", "_")
        report.figure(f"{prefix}_num_requests", r.num_requests)
        for key, _ in COLUMNS:
            report.figure(f"{prefix}_{key}", getattr(r, key))
    if ours is not None:
        report.figure("decode_balance_efficiency", ours.decode_balance_efficiency)
        if "round-robin" in by_name:
            report.figure("ttft_p99_ratio_rr_over_ours", by_name["round-robin"].ttft_p99_s / ours.ttft_p99_s)
        # hit rates compared over the turns both policies served (see same_turn_hit_rates)
        gaps = []
        for r in results:
            if is_affinity_only(r.name):
                ref, mine = same_turn_hit_rates(r, ours)
                report.figure(f"{r.name.replace('-', '_')}_vs_ours_same_turn_hit_rates", f"{ref:.4f} vs {mine:.4f}")
                gaps.append(100.0 * (ref - mine))
        if gaps:
            report.figure("hit_rate_gap_vs_affinity_points", max(gaps))
    report.figure("session_rate_per_s", summary.session_rate)
    report.figure("ideal_prefill_load", summary.ideal_prefill_load)
    report.figure("decode_slots_per_rank", summary.decode_max_requests)
    report.figure("wall_s", time.perf_counter() - start)
    report.finish(args.json)
    return 0
