"""The cluster: prefill engines, one lockstep decode group, VE instances, and an event loop.

A turn's path, as in the disaggregated runtime (ARCHITECTURE.md, "A request's path"):

    arrival --(images?)--> VE instances --> prefill router + decode balancer choose both engines
        --> prefill queue (FIFO) --> prefill done: first token (TTFT), blocks cached, cache events
        --> KV handoff over the network --> decode rank: wait for a slot, one token per step
        --> last token: the session's next turn arrives ``think_s`` later

Policies see what a gateway would. Each of ``num_gateways`` gateways (a session always uses the
same one) holds its own policy instances and routes on engine load reports that arrive every
``heartbeat_s`` plus the work it routed since (``runtime.balance.load_view``); it does not see
what the other gateways routed until the next report. Cache events (stored / evicted block
hashes) reach every gateway's shared ``PrefixIndex`` as they happen, and tiered routers share one
``TierPlanner``. With ``heartbeat_s = 0`` one gateway reads exact live loads instead.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

from deepinfer_bench.sim.engines import DecodeGroup, PrefillEngine, SimRequest, VEInstance
from deepinfer_bench.sim.metrics import PolicyResult, percentile, weighted_percentile
from deepinfer_bench.sim.policies import PolicySet, build_planner, build_policy
from deepinfer_bench.sim.workload import Trace

from deepinfer.runtime.balance import DecodeStepCost, PrefillCost, PrefixIndex, RequestInfo
from deepinfer.runtime.balance.load_view import DecodeLoadView, PrefillLoadView

_ARRIVAL, _VE_DONE, _PREFILL_DONE, _HANDOFF_DONE, _DECODE_STEP, _HEARTBEAT = range(6)
SHORT_PROMPT_TOKENS = 16 * 1024


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    num_prefill: int = 16
    num_decode: int = 16
    num_ve: int = 4
    prefill_cost: PrefillCost = field(default_factory=PrefillCost)
    decode_cost: DecodeStepCost = field(default_factory=DecodeStepCost)
    # HBM left for cached blocks on one prefill rank: ~80 GB at ~890 bytes/token (V4.1-Flash)
    prefill_cache_tokens: int = 90_000_000
    decode_load: float = 0.8  # target mean slot occupancy; sizes decode_max_requests
    decode_max_requests: int = 0  # 0: size from the trace for decode_load
    decode_kv_capacity_tokens: int = 60_000_000
    kv_bytes_per_token: int = 890
    handoff_bytes_per_s: float = 5e9  # 400 Gb/s per 8 GPUs, one rank's share
    handoff_latency_s: float = 1e-3
    ve_load: float = 0.7  # target VE utilisation; sizes the per-token encode cost
    ve_image_s: float = 2e-3
    # Gateways route independently on heartbeat load reports + their own routed work
    # (runtime.balance.load_view); a session sticks to one gateway. heartbeat_s = 0 gives one
    # gateway that reads exact live loads (an optimistic bound on what routing can know).
    num_gateways: int = 4
    heartbeat_s: float = 0.1

    def __post_init__(self) -> None:
        if self.num_gateways < 1 or self.heartbeat_s < 0:
            raise ValueError(f"need num_gateways >= 1 and heartbeat_s >= 0, got {self.num_gateways}, {self.heartbeat_s}")
        if min(self.num_prefill, self.num_decode, self.num_ve) < 1:
            raise ValueError(f"every pool needs at least one engine, got {self.num_prefill}/{self.num_decode}/{self.num_ve}")
        if not 0 < self.decode_load <= 1 or not 0 < self.ve_load < 1:
            raise ValueError(f"decode_load must be in (0, 1] and ve_load in (0, 1), got {self.decode_load}, {self.ve_load}")


@dataclass(frozen=True, slots=True)
class Sizing:
    """Pool parameters solved from the trace's nominal timeline (think times, no serving delay)."""

    decode_max_requests: int
    ve_token_s: float
    nominal_decode_concurrency: float


def size_pools(trace: Trace, cluster: ClusterConfig) -> Sizing:
    cfg = trace.config
    num_out, kv_weighted, num_images, num_image_tokens = 0.0, 0.0, 0, 0
    for s in trace.sessions:
        t = s.start_s
        for k, turn in enumerate(s.turns):
            t += turn.think_s
            if t >= cfg.duration_s:
                break
            m = turn.output_tokens - 1
            num_out += m
            kv_weighted += (s.prompt_tokens(k) + m / 2) * m  # mean KV over its decode, times its length
            num_images += len(turn.image_tokens)
            num_image_tokens += sum(turn.image_tokens)
    cost = cluster.decode_cost
    mean_kv = kv_weighted / max(num_out, 1.0)
    token_rate = num_out / cfg.duration_s
    # Little's law with the balanced step time: concurrency = token rate x step time
    concurrency = 1.0
    for _ in range(50):
        per_rank = concurrency / cluster.num_decode
        step = cost.rank_seconds(per_rank, per_rank * mean_kv) + cost.shared_seconds(per_rank)
        concurrency = token_rate * step
    max_requests = cluster.decode_max_requests or max(1, math.ceil(concurrency / cluster.num_decode / cluster.decode_load))
    image_rate = num_images / cfg.duration_s
    image_token_rate = num_image_tokens / cfg.duration_s
    budget = cluster.ve_load * cluster.num_ve - cluster.ve_image_s * image_rate
    ve_token_s = budget / image_token_rate if image_token_rate > 0 and budget > 0 else 1e-5
    return Sizing(max_requests, ve_token_s, concurrency)


class Gateway:
    """One gateway: its own policy instances and, with heartbeats, its own view of engine load."""

    def __init__(self, policy: PolicySet, has_views: bool):
        self.policy = policy
        self.prefill_view = PrefillLoadView() if has_views else None
        self.decode_view = DecodeLoadView() if has_views else None


class Simulation:
    def __init__(self, trace: Trace, cluster: ClusterConfig, policy_name: str, sizing: Sizing):
        self.trace = trace
        self.cfg = trace.config
        self.cluster = cluster
        self.sizing = sizing
        cache_blocks = max(1, cluster.prefill_cache_tokens // self.cfg.block_size)
        index, planner = PrefixIndex(), build_planner(policy_name)
        has_views = cluster.heartbeat_s > 0
        self.gateways = [
            Gateway(build_policy(policy_name, cluster.prefill_cost, cluster.decode_cost, cache_blocks, index, planner),
                    has_views)
            for _ in range(cluster.num_gateways if has_views else 1)
        ]
        self.policy = self.gateways[0].policy
        bs = self.cfg.block_size
        capacity_blocks = max(1, cluster.prefill_cache_tokens // bs)
        self.prefill = [PrefillEngine(i, cluster.prefill_cost, capacity_blocks, bs) for i in range(cluster.num_prefill)]
        self.decode = DecodeGroup(cluster.num_decode, cluster.decode_cost, sizing.decode_max_requests,
                                  cluster.decode_kv_capacity_tokens)
        self.ve = [VEInstance(i, cluster.ve_image_s, sizing.ve_token_s) for i in range(cluster.num_ve)]
        self._events: list = []
        self._seq = 0
        self.requests: list[SimRequest] = []
        self.ve_waits: list[tuple[float, float]] = []  # (arrival, wait)

    # ---- event plumbing -------------------------------------------------------------
    def _at(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def run(self) -> PolicyResult:
        cpu = time.process_time()
        for s in self.trace.sessions:
            self._at(s.start_s, _ARRIVAL, (s, 0))
        if self.cluster.heartbeat_s > 0:
            self._at(0.0, _HEARTBEAT, None)
        events = self._events
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if kind == _ARRIVAL:
                self._arrive(now, *payload)
            elif kind == _VE_DONE:
                self._ve_done(now, payload)
            elif kind == _PREFILL_DONE:
                self._prefill_done(now, payload)
            elif kind == _HANDOFF_DONE:
                self._handoff_done(now, payload)
            elif kind == _DECODE_STEP:
                self._decode_step_done(now)
            else:
                self._heartbeat(now)
        return self._result(time.process_time() - cpu)

    # ---- request path ---------------------------------------------------------------
    def _arrive(self, now: float, session, k: int) -> None:
        turn = session.turns[k]
        num_tokens = session.prompt_tokens(k)
        hashes = session.block_hashes(num_tokens, self.cfg.block_size)
        req = SimRequest(len(self.requests), session, k, now, num_tokens, hashes, turn.output_tokens, turn.image_tokens)
        req.info = RequestInfo(req.request_id, num_tokens, hashes, self.cfg.block_size, turn.image_tokens)
        self.requests.append(req)
        if not turn.image_tokens:
            self._route(now, req)
            return
        gw = self.gateways[req.session.session_id % len(self.gateways)]
        plan = gw.policy.ve.assign(turn.image_tokens, [v.load() for v in self.ve])
        for num_tokens_img, e in zip(turn.image_tokens, plan.image2engine, strict=True):
            self.ve[e].enqueue(req, num_tokens_img)
            self._start_ve(now, e)

    def _start_ve(self, now: float, e: int) -> None:
        end = self.ve[e].start_next(now)
        if end is not None:
            self._at(end, _VE_DONE, e)

    def _ve_done(self, now: float, e: int) -> None:
        req = self.ve[e].finish()
        req.num_images_left -= 1
        if req.num_images_left == 0:
            self.ve_waits.append((req.arrival_s, now - req.arrival_s))
            self._route(now, req)
        self._start_ve(now, e)

    def _heartbeat(self, now: float) -> None:
        prefill_loads = [p.load(now) for p in self.prefill]
        decode_loads = self.decode.loads()
        for gw in self.gateways:
            gw.prefill_view.on_reports(now, prefill_loads)
            gw.decode_view.on_reports(now, decode_loads)
        if self._events:  # keep beating while anything else is scheduled
            self._at(now + self.cluster.heartbeat_s, _HEARTBEAT, None)

    def _route(self, now: float, req: SimRequest) -> None:
        info = req.info
        gw = self.gateways[req.session.session_id % len(self.gateways)]
        group = self.decode
        if gw.prefill_view is None:
            choice = gw.policy.prefill.route(info, [p.load(now) for p in self.prefill], now)
            target = gw.policy.decode.place(info, group.loads())
        else:
            choice = gw.policy.prefill.route(info, gw.prefill_view.loads(now), now)
            target = gw.policy.decode.place(info, gw.decode_view.loads())
            cached = choice.num_cached_tokens
            predicted = choice.predicted_s or self.cluster.prefill_cost.seconds(req.num_prompt_tokens - cached, cached)
            gw.prefill_view.on_routed(now, choice.engine_id, predicted)
            gw.decode_view.on_routed(now, target.engine_id, req.num_prompt_tokens)
        req.prefill_id = choice.engine_id
        group.assign(target.engine_id, req)
        engine = self.prefill[choice.engine_id]
        engine.enqueue(req)
        self._start_prefill(now, engine)

    def _start_prefill(self, now: float, engine: PrefillEngine) -> None:
        end = engine.start_next(now)
        if end is not None:
            self._at(end, _PREFILL_DONE, engine.engine_id)

    def _prefill_done(self, now: float, e: int) -> None:
        engine = self.prefill[e]
        req, stored, evicted = engine.finish()
        index = self.policy.index  # shared by every gateway
        if index is not None:
            if stored:
                index.on_stored(e, stored)
            if evicted:
                index.on_evicted(e, evicted)
        req.first_token_s = now
        if req.num_output_tokens <= 1:
            self.decode.unassign(req.decode_id, req)
            req.finish_s = now
            self._complete(now, req)
        else:
            transfer = self.cluster.handoff_latency_s + req.num_prompt_tokens * self.cluster.kv_bytes_per_token / self.cluster.handoff_bytes_per_s
            req.handoff_s = now
            self._at(now + transfer, _HANDOFF_DONE, req)
        self._start_prefill(now, engine)

    def _handoff_done(self, now: float, req: SimRequest) -> None:
        self.decode.arrive(req.decode_id, req)
        if not self.decode.is_stepping:
            end = self.decode.begin_step(now)
            if end is not None:
                self._at(end, _DECODE_STEP, None)

    def _decode_step_done(self, now: float) -> None:
        for req in self.decode.end_step(now):
            self._complete(now, req)
        end = self.decode.begin_step(now)
        if end is not None:
            self._at(end, _DECODE_STEP, None)

    def _complete(self, now: float, req: SimRequest) -> None:
        session, k = req.session, req.turn + 1
        if k < len(session.turns):
            t = now + session.turns[k].think_s
            if t < self.cfg.duration_s:
                self._at(t, _ARRIVAL, (session, k))

    # ---- figures --------------------------------------------------------------------
    def _result(self, cpu_s: float) -> PolicyResult:
        lo, hi = self.cfg.warmup_s, self.cfg.duration_s
        window = hi - lo
        reqs = [r for r in self.requests if lo <= r.arrival_s < hi]
        ttft = [r.first_token_s - r.arrival_s for r in reqs]
        ttft_short = [r.first_token_s - r.arrival_s for r in reqs if r.num_prompt_tokens < SHORT_PROMPT_TOKENS]
        steps = [s for s in self.decode.steps if lo <= s.start_s < hi]
        gaps = [(s.seconds, s.num_running - s.num_first) for s in steps]
        gaps += [(gap, 1) for t, gap in self.decode.first_gaps if lo <= t < hi]
        num_prompt = sum(r.num_prompt_tokens for r in reqs)
        # busy seconds inside the window (a prefill started before it or ending after it counts in part)
        prefill_busy = sum(max(0.0, min(r.first_token_s, hi) - max(r.prefill_start_s, lo)) for r in self.requests)
        num_emitted = sum(s.num_running for s in steps)
        slots = self.decode.max_requests * self.decode.num_ranks
        return PolicyResult(
            name=self.policy.name,
            num_requests=len(reqs),
            ttft_p50_s=percentile(ttft, 50),
            ttft_p99_s=percentile(ttft, 99),
            ttft_short_p99_s=percentile(ttft_short, 99),
            itl_p50_ms=1e3 * weighted_percentile(gaps, 50),
            itl_p99_ms=1e3 * weighted_percentile(gaps, 99),
            throughput_tok_s=num_emitted / window,
            hit_rate=sum(r.num_cached_tokens for r in reqs) / max(1, num_prompt),
            decode_balance_efficiency=sum(s.balanced_seconds for s in steps) / max(1e-12, sum(s.seconds for s in steps)),
            prefill_utilization=prefill_busy / (window * len(self.prefill)),
            decode_occupancy=num_emitted / max(1, len(steps)) / slots,
            ve_wait_p99_s=percentile([w for t, w in self.ve_waits if lo <= t < hi], 99),
            cpu_s=cpu_s,
            turn2tokens={(r.session.session_id, r.turn): (r.num_cached_tokens, r.num_prompt_tokens) for r in reqs},
        )
