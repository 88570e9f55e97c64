"""`deepinfer bench store`: erasure coding and storage-cluster throughput, healthy and degraded.

1. Codec: encode and decode (from k fragments with two data fragments missing, i.e. a real
   reconstruction) of ``--object-size`` objects, through our path (ErasureCodec: CRC-32C per
   fragment, bound headers, checks) and through raw pyeclib, sampled round-robin in one run.
2. Cluster: ``--nodes`` storage daemons as local processes (``deepinfer storage``, started with
   the test-only ``--debug-hooks`` so one node's delay can be switched at run time), one
   ClusterStore in this process:
   - put ``--num-objects`` objects (batches of ``--batch``), then get them all back, healthy;
   - p99 of single-object reads with one daemon delayed 200 ms per request vs healthy, in
     interleaved blocks so background load hits both alike (hedged reads: decode from the first
     k of k+1 answers);
   - degraded writes: SIGKILL one daemon and put ``--num-objects`` new objects (k+1 of k+m
     fragments each; the client's probe connection sees the crash at once), against the healthy
     put of the same count just before; restart the daemon and time the daemons' repair (they run
     with the membership file) until every degraded object has its k+m fragments on disk again;
   - SIGKILL two daemons (the client is not told: its probes and hedging route around them) and
     get everything again; count reads that did not return byte-identical data.

3. ``--engine-ttft``: an AsyncEngine on the built-in tiny model started with
   ``kv_store_nodes`` = those daemons (``deepinfer serve --kv-store-nodes``): per repetition a
   fresh ``--engine-prompt-len``-token prompt is computed (TTFT "computed"), its blocks are
   written behind to the cluster, the device prefix cache is dropped (as eviction by other
   prompts would), and the same prompt is asked again (TTFT "store": blocks read from the
   cluster, then the exact SWA replay of sliding_window x layers tokens and the prompt's tail).

GB/s = object (logical) bytes / wall time. Every daemon and this process share the machine's
cores: on a small machine this measures the software path under CPU contention, not disks.

JSON keys: ``ec_encode_GBps``, ``pyeclib_encode_GBps``, ``ec_decode_GBps``, ``pyeclib_decode_GBps``
(2 data fragments missing), ``ec_decode_verify_GBps`` (with the CRC pass),
``ec_decode_all_data_GBps``/``pyeclib_decode_all_data_GBps`` (every data fragment at hand),
``cluster_put_GBps``, ``cluster_get_GBps``, ``cluster_get_GBps_2_down``, ``reads_failed_2_down``,
``healthy_write_GBps`` / ``degraded_write_GBps`` (one daemon down) and their ratio
``degraded_vs_healthy_write`` (target >= 0.8; medians of ``--repair-rounds`` alternating rounds,
the per-round ratios in ``degraded_vs_healthy_write_rounds``), ``repair_MBps`` (fragment bytes the daemons rebuilt
per second, from the restarted daemon's ready line until every object is whole), ``repair_s``,
``repaired_fragments``,
``hedged_read_p99_ratio_one_slow`` (+ the two p99s in ms), ``num_cpus``, ``num_nodes``, ``k``, ``m``;
with ``--engine-ttft``: ``engine_ttft_ms_computed``, ``engine_ttft_ms_store`` (medians),
``engine_store_cached_tokens``, ``engine_prompt_len``.
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time

from deepinfer_bench.report import Report, base_parser
from pyeclib.ec_iface import ECDriver

from deepinfer.cache.store import fragment_file as ff
from deepinfer.cache.store.api import deadline_after
from deepinfer.cache.store.client import ClusterStore, ClusterStoreConfig
from deepinfer.cache.store.ec import ECConfig, ErasureCodec
from deepinfer.cache.store.local_cluster import LocalCluster
from deepinfer.runtime import loop as runtime_loop
from deepinfer.transport.protocol import DebugSet

MiB = 1 << 20


def parse_args(argv):
    p = base_parser("store", "Erasure coding and storage-cluster put/get throughput, healthy and with 2 nodes down.")
    p.add_argument("--k", type=int, default=10, help="data fragments per object")
    p.add_argument("--m", type=int, default=2, help="parity fragments per object")
    p.add_argument("--nodes", type=int, default=12, help="storage daemons to start (>= k+m)")
    p.add_argument("--object-size", type=int, default=1 * MiB, help="bytes per object")
    p.add_argument("--num-objects", type=int, default=64, help="objects written and read back")
    p.add_argument("--batch", type=int, default=8, help="objects per put/get call")
    p.add_argument("--codec-repeat", type=int, default=20, help="encode/decode samples per path")
    p.add_argument("--slow-reads", type=int, default=240, help="single-object reads per side of the p99 comparison")
    p.add_argument("--slow-delay-ms", type=float, default=200.0, help="delay of the slow daemon")
    p.add_argument("--repair-rounds", type=int, default=3,
                   help="rounds of healthy put / one daemon killed, degraded put / restart and repair")
    p.add_argument("--engine-ttft", action="store_true",
                   help="also measure an engine's TTFT of a prompt served from the cluster vs computed")
    p.add_argument("--engine-prompt-len", type=int, default=4000, help="prompt tokens of --engine-ttft")
    p.add_argument("--engine-reps", type=int, default=3, help="prompts measured by --engine-ttft")
    p.add_argument("--skip-throughput", action="store_true", help="skip the codec and get/put figures")
    args = p.parse_args(argv)
    if args.engine_prompt_len < 256 or args.engine_reps < 1:
        p.error("--engine-prompt-len must be >= 256 and --engine-reps >= 1")
    if args.nodes < args.k + args.m:
        p.error(f"--nodes {args.nodes} cannot hold a coding group of k+m = {args.k + args.m}")
    if args.m < 2:
        p.error("--m must be >= 2: the benchmark kills two daemons")
    if args.repair_rounds < 1:
        p.error("--repair-rounds must be >= 1")
    return args


def bench_codec(args, report: Report) -> None:
    config = ECConfig(args.k, args.m)
    ours = ErasureCodec(config)
    raw = ECDriver(k=args.k, m=args.m, ec_type=config.ec_type)
    data = os.urandom(args.object_size)
    frags = ours.encode(b"bench", data)
    raw_frags = raw.encode(data)
    # decode from fragments 2..k+1: two data fragments missing, so parity is used; the client
    # path skips the CRC pass (the node checked each payload before sending it)
    ours_in, raw_in = frags[2 : args.k + 2], raw_frags[2 : args.k + 2]
    all_data, raw_all_data = frags[: args.k], raw_frags[: args.k]
    paths = {
        "ec_encode": lambda: ours.encode(b"bench", data),
        "pyeclib_encode": lambda: raw.encode(data),
        "ec_decode": lambda: ours.decode(ours_in, verify=False),
        "ec_decode_verify": lambda: ours.decode(ours_in),
        "pyeclib_decode": lambda: raw.decode(raw_in),
        "ec_decode_all_data": lambda: ours.decode(all_data, verify=False),
        "pyeclib_decode_all_data": lambda: raw.decode(raw_all_data),
    }
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.codec_repeat):  # round-robin: load changes hit every path alike
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    assert ours.decode(ours_in) == data == raw.decode(raw_in) == ours.decode(all_data)
    for name, times in samples.items():
        gbps = args.object_size / sorted(times)[len(times) // 2] / 1e9
        report.figure(f"{name}_GBps", gbps)
        report.row(measure=name, GBps=gbps, note=f"{args.object_size // 1024} KiB object, k={args.k} m={args.m}")


async def _timed(coro):
    t0 = time.perf_counter()
    result = await coro
    return result, time.perf_counter() - t0


async def bench_cluster(args, cluster: LocalCluster, report: Report) -> None:
    rng = random.Random(0)
    objs = {rng.randbytes(16): rng.randbytes(args.object_size) for _ in range(args.num_objects)}
    keys = list(objs)
    batches = [keys[i : i + args.batch] for i in range(0, len(keys), args.batch)]
    total = args.object_size * len(keys)
    config = ClusterStoreConfig(ec=ECConfig(args.k, args.m))
    async with ClusterStore(cluster.addresses, config) as store:
        t0 = time.perf_counter()
        for batch in batches:
            acks = await store.put_blocks([(k, objs[k]) for k in batch], traffic_class="chat", deadline=deadline_after(60))
            assert all(a.is_ok for a in acks), [a.message for a in acks if not a.is_ok][:2]
        put_gbps = total / (time.perf_counter() - t0) / 1e9

        async def get_all() -> tuple[float, int]:
            num_failed = 0
            t0 = time.perf_counter()
            for batch in batches:
                for r in await store.get_blocks(batch, deadline=deadline_after(30)):
                    num_failed += r.data != objs[r.key]
            return total / (time.perf_counter() - t0) / 1e9, num_failed

        await get_all()  # warm-up: connections, page cache
        get_gbps, num_failed = await get_all()
        assert num_failed == 0, f"{num_failed} healthy reads failed"
        report.row(measure="cluster_put", GBps=put_gbps, note=f"{len(keys)} x {args.object_size // 1024} KiB, all k+m acked")
        report.row(measure="cluster_get", GBps=get_gbps, note=f"batches of {args.batch}")
        report.figure("cluster_put_GBps", put_gbps)
        report.figure("cluster_get_GBps", get_gbps)

        # hedging: one slow daemon vs none, interleaved blocks of single-object reads
        slow = cluster.names[0]
        healthy, slowed = [], []
        num_blocks = 4
        per_block = max(1, args.slow_reads // num_blocks)
        for _ in range(num_blocks):
            for delay, sink in ((0.0, healthy), (args.slow_delay_ms, slowed)):
                await store.request_node(slow, DebugSet(delay_ms=delay))
                for i in range(per_block):
                    key = keys[i % len(keys)]
                    (r,), dt = await _timed(store.get_blocks([key], deadline=deadline_after(5)))
                    assert r.data == objs[key]
                    sink.append(dt)
        await store.request_node(slow, DebugSet(delay_ms=0))
        p99 = lambda xs: sorted(xs)[max(0, int(0.99 * len(xs)) - 1)]  # noqa: E731
        ratio = p99(slowed) / p99(healthy)
        report.row(measure="read_p99_healthy", ms=p99(healthy) * 1e3, note=f"{len(healthy)} single-object reads")
        report.row(measure="read_p99_one_slow", ms=p99(slowed) * 1e3, note=f"{slow} +{args.slow_delay_ms:g} ms/request")
        report.figure("read_p99_healthy_ms", p99(healthy) * 1e3)
        report.figure("read_p99_one_slow_ms", p99(slowed) * 1e3)
        report.figure("hedged_read_p99_ratio_one_slow", ratio)

        await bench_degraded_and_repair(args, cluster, store, report)

        # two daemons SIGKILLed; the client is not told
        for name in cluster.names[1:3]:
            cluster.kill(name)
        down_gbps, num_failed = await get_all()
        report.row(measure="cluster_get_2_down", GBps=down_gbps, note=f"{cluster.names[1]}, {cluster.names[2]} SIGKILLed")
        report.figure("cluster_get_GBps_2_down", down_gbps)
        report.figure("reads_failed_2_down", num_failed)
        report.figure("client_hedged_reads", store.stats.num_hedged)


async def bench_degraded_and_repair(args, cluster: LocalCluster, store: ClusterStore, report: Report) -> None:
    rng = random.Random(1)
    total = args.object_size * args.num_objects
    n = args.k + args.m
    victim = cluster.names[-1]

    async def put_all() -> tuple[float, dict[bytes, bytes], set[int]]:
        objs = {rng.randbytes(16): rng.randbytes(args.object_size) for _ in range(args.num_objects)}
        keys, num_acks = list(objs), set()
        t0 = time.perf_counter()
        for i in range(0, len(keys), args.batch):
            acks = await store.put_blocks([(k, objs[k]) for k in keys[i : i + args.batch]], traffic_class="chat",
                                          deadline=deadline_after(60))  # fmt: skip
            assert all(a.is_ok for a in acks), [a.message for a in acks if not a.is_ok][:2]
            num_acks |= {a.num_acks for a in acks}
        return total / (time.perf_counter() - t0) / 1e9, objs, num_acks

    def num_short(keys) -> int:
        roots = [cluster.root / name / "frags" for name in cluster.names]
        return sum(sum(ff.fragment_path(r, key).exists() for r in roots) < n for key in keys)

    async def repair_bytes() -> int:
        return sum(s.num_repair_bytes for s in (await store.node_stats()).values() if s)

    healthy, degraded, repair_mbps, repair_s = [], [], [], []
    for _ in range(args.repair_rounds):  # alternate: background load hits both sides alike
        gbps, _, _ = await put_all()
        healthy.append(gbps)
        cluster.kill(victim)
        while store.reachability.is_reachable(victim):  # the probe sees the crash within milliseconds
            await asyncio.sleep(0.01)
        gbps, objs, num_acks = await put_all()
        degraded.append(gbps)
        assert num_acks == {n - 1}, f"degraded writes stored {num_acks} fragments, expected {n - 1}"
        before = await repair_bytes()
        cluster.restart(victim)
        t0 = time.perf_counter()  # from the moment it serves again (its process start is not repair)
        while num_short(objs):
            assert time.perf_counter() - t0 < 300, f"{num_short(objs)} objects still short of {n} fragments after 300 s"
            await asyncio.sleep(0.05)
        repair_s.append(time.perf_counter() - t0)
        repair_mbps.append((await repair_bytes() - before) / repair_s[-1] / 1e6)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rounds = f"median of {args.repair_rounds} rounds"
    report.row(measure="healthy_write", GBps=median(healthy), note=f"{args.num_objects} objects, all {n} nodes up, {rounds}")
    report.row(measure="degraded_write", GBps=median(degraded), note=f"{victim} SIGKILLed: {n - 1} fragments each")
    report.row(measure="repair", MBps=median(repair_mbps),
               note=f"{args.num_objects} objects whole again {median(repair_s):.2f} s after {victim} served again")
    report.figure("healthy_write_GBps", median(healthy))
    report.figure("degraded_write_GBps", median(degraded))
    report.figure("degraded_vs_healthy_write", median(degraded) / median(healthy))
    report.figure("degraded_vs_healthy_write_rounds", ",".join(f"{d / h:.2f}" for d, h in zip(degraded, healthy)))
    report.figure("repair_MBps", median(repair_mbps))
    report.figure("repair_s", median(repair_s))
    report.figure("repaired_fragments", args.num_objects)


async def bench_engine_ttft(args, cluster: LocalCluster, report: Report) -> None:
    from deepinfer.engine.api.async_engine import AsyncEngine
    from deepinfer.engine.api.sampling_params import SamplingParams
    from deepinfer.runtime.gateway.builtin_model import ensure_builtin_model

    model_dir, _ = ensure_builtin_model(show_progress=False)
    engine = await AsyncEngine.start(
        model=str(model_dir), device="cpu", max_num_seqs=1, max_model_len=args.engine_prompt_len + 64,
        kv_store_nodes=",".join(cluster.addresses.values()), kv_store_ec=f"{args.k}+{args.m}", kv_load_deadline_s=30.0)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def ttft(ids):
        t0, first, tokens, last = time.perf_counter(), None, [], None
        async for out in engine.generate({"prompt_token_ids": ids}, params):
            first = first if first is not None else time.perf_counter() - t0
            tokens += out.outputs[0].token_ids
            last = out
        return first, tokens, last

    try:
        offload = engine.core.kv_offload
        computed, from_store, cached = [], [], []
        for rep in range(args.engine_reps):
            rng = random.Random(1000 + rep)
            ids = [rng.randrange(10, 4000) for _ in range(args.engine_prompt_len)]
            seconds, want, out = await ttft(ids)
            assert out.num_cached_tokens == 0
            computed.append(seconds)
            num_blocks = (len(ids) - 1) // engine.options.block_size
            written = offload.stats.num_written_store + num_blocks
            while offload.stats.num_written_store < written:  # write-behind reaches the cluster
                await asyncio.sleep(0.05)
            engine.core.scheduler.pool.evict_all_unreferenced()  # as other prompts would
            seconds, got, out = await ttft(ids)
            assert got == want, "a store hit changed the tokens"
            from_store.append(seconds)
            cached.append(out.metrics.cached_tokens_by_tier.get("store", 0))
    finally:
        await engine.shutdown()
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    note = f"{args.engine_prompt_len}-token prompt, tiny model, median of {args.engine_reps}"
    report.row(measure="engine_ttft_computed", ms=median(computed) * 1e3, note=note)
    report.row(measure="engine_ttft_store", ms=median(from_store) * 1e3, note=f"{median(cached)} tokens from the cluster")
    report.figure("engine_ttft_ms_computed", median(computed) * 1e3)
    report.figure("engine_ttft_ms_store", median(from_store) * 1e3)
    report.figure("engine_store_cached_tokens", median(cached))
    report.figure("engine_prompt_len", args.engine_prompt_len)


def main(argv) -> int:
    args = parse_args(argv)
    report = Report(f"store: k={args.k} m={args.m}, {args.nodes} local daemons, {os.cpu_count()} CPUs shared by all")
    report.figure("num_cpus", os.cpu_count())
    report.figure("num_nodes", args.nodes)
    report.figure("k", args.k)
    report.figure("m", args.m)
    if not args.skip_throughput:
        bench_codec(args, report)
    floor_mib = 256 if args.engine_ttft else 1  # the engine writes every prompt block behind
    num_puts = 2 + 2 * args.repair_rounds  # cluster put + two per repair round, with room to spare
    capacity = f"{max(floor_mib, 2 * num_puts * args.object_size * args.num_objects // args.k // MiB)}MiB"
    with tempfile.TemporaryDirectory(prefix="bench-store-") as root:
        # the daemons repair (membership file), retry a short object every 0.2 s and are not throttled:
        # the benchmark measures the repair path, not --repair-rate
        repair_args = ["--repair-retry", "0.2", "--membership-poll", "0.2", "--repair-rate", "10GB"]
        with LocalCluster(root, args.nodes, capacity=capacity, membership=True, ec=(args.k, args.m),
                          extra_args=["--debug-hooks", *repair_args]) as cluster:  # fmt: skip
            if args.engine_ttft:  # first: the throughput part kills two daemons
                runtime_loop.run(bench_engine_ttft(args, cluster, report))
            if not args.skip_throughput:
                runtime_loop.run(bench_cluster(args, cluster, report))
    report.finish(args.json)
    return 0
