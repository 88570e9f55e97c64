"""Simulated engines: prefill servers with LRU prefix caches, a lockstep decode group, VE servers.

All three are passive state machines: the cluster's event loop calls them and schedules the
completion times they return. Nothing here decides where a request goes.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from deepinfer.runtime.balance.cost_model import DecodeStepCost, PrefillCost
from deepinfer.runtime.balance.types import DecodeLoad, PrefillLoad, VELoad


class SimRequest:
    """One turn of one session on its way through the cluster (times in simulated seconds)."""

    __slots__ = (
        "request_id", "session", "turn", "arrival_s", "num_prompt_tokens", "block_hashes", "num_output_tokens",
        "image_tokens", "num_images_left", "prefill_id", "decode_id", "est_prefill_s", "num_cached_tokens",
        "prefill_start_s", "first_token_s", "handoff_s", "decode_admit_step", "finish_s", "info",
    )

    def __init__(self, request_id, session, turn, arrival_s, num_prompt_tokens, block_hashes, num_output_tokens,
                 image_tokens):
        self.request_id = request_id
        self.session = session
        self.turn = turn
        self.arrival_s = arrival_s
        self.num_prompt_tokens = num_prompt_tokens
        self.block_hashes = block_hashes
        self.num_output_tokens = num_output_tokens
        self.image_tokens = image_tokens
        self.num_images_left = len(image_tokens)
        self.prefill_id = self.decode_id = -1
        self.est_prefill_s = 0.0
        self.num_cached_tokens = 0
        self.prefill_start_s = self.first_token_s = self.handoff_s = self.finish_s = -1.0
        self.decode_admit_step = -1
        self.info = None


class PrefillEngine:
    """A FIFO prefill server (one data-parallel rank) with an LRU prefix cache of blocks.

    The cache keeps prompt blocks of finished prefills. Blocks are touched tail first, so the
    root of every chain is the most recent and LRU evicts leaves before their parents: what stays
    cached is always a prefix, as in an engine that frees a request's blocks in reverse order.
    """

    def __init__(self, engine_id: int, cost: PrefillCost, capacity_blocks: int, block_size: int):
        self.engine_id = engine_id
        self.cost = cost
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.cache: OrderedDict = OrderedDict()
        self.queue: deque[SimRequest] = deque()
        self.current: SimRequest | None = None
        self.busy_until = 0.0
        self.queued_s = 0.0
        self.busy_s = 0.0  # compute seconds started so far

    def num_hit_tokens(self, req: SimRequest) -> int:
        # the cache is prefix-closed (see the class docstring), so the hit length is the last
        # index whose block is cached: binary search instead of a walk
        cache, hashes = self.cache, req.block_hashes
        lo, hi = 0, len(hashes)  # invariant: hashes[:lo] cached, hashes[hi:] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in cache:
                lo = mid
            else:
                hi = mid - 1
        return min(lo * self.block_size, req.num_prompt_tokens - 1)

    def load(self, now: float) -> PrefillLoad:
        if self.current is None:
            return PrefillLoad(self.engine_id, len(self.queue), self.queued_s)
        return PrefillLoad(self.engine_id, len(self.queue) + 1, self.queued_s + max(0.0, self.busy_until - now))

    def enqueue(self, req: SimRequest) -> None:
        hit = self.num_hit_tokens(req)
        req.est_prefill_s = self.cost.seconds(req.num_prompt_tokens - hit, hit)
        self.queue.append(req)
        self.queued_s += req.est_prefill_s

    def start_next(self, now: float) -> float | None:
        """Start the next queued prefill if idle; returns its finish time."""
        if self.current is not None or not self.queue:
            return None
        req = self.queue.popleft()
        self.queued_s = max(0.0, self.queued_s - req.est_prefill_s)
        hit = self.num_hit_tokens(req)
        seconds = self.cost.seconds(req.num_prompt_tokens - hit, hit)
        req.num_cached_tokens = hit
        req.prefill_start_s = now
        self.current = req
        self.busy_until = now + seconds
        self.busy_s += seconds
        return self.busy_until

    def finish(self) -> tuple[SimRequest, list, list]:
        """Complete the running prefill: cache its blocks; returns (request, stored, evicted)."""
        req, self.current = self.current, None
        cache = self.cache
        stored = []
        for h in reversed(req.block_hashes):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                stored.append(h)
        evicted = []
        while len(cache) > self.capacity_blocks:
            evicted.append(cache.popitem(last=False)[0])
        return req, stored, evicted


@dataclass(slots=True)
class StepRecord:
    start_s: float
    seconds: float
    balanced_seconds: float
    num_running: int  # requests that emitted a token in this step
    num_first: int  # of them, requests in their first decode step (their gap is not this step's time)


class DecodeGroup:
    """The decode ranks of one expert-parallel group, stepping in lockstep.

    Every step each running request on every rank emits one token; the step lasts as long as the
    slowest rank (``DecodeStepCost.step_seconds``). Beside it the step's *balanced* time is
    recorded: the same requests and KV spread perfectly evenly. A request's first token comes
    from prefill; it then needs ``num_output_tokens - 1`` decode steps.
    """

    def __init__(self, num_ranks: int, cost: DecodeStepCost, max_requests: int, kv_capacity_tokens: int):
        self.num_ranks = num_ranks
        self.cost = cost
        self.max_requests = max_requests
        self.kv_capacity_tokens = kv_capacity_tokens
        self.rank2running = [0] * num_ranks
        self.rank2kv = [0] * num_ranks
        self.rank2waiting: list[deque[SimRequest]] = [deque() for _ in range(num_ranks)]
        self.rank2waiting_kv = [0] * num_ranks
        self.rank2incoming = [0] * num_ranks
        self.rank2incoming_kv = [0] * num_ranks
        self._finish_heap: list[tuple[int, int, SimRequest]] = []
        self.step_idx = 0
        self.is_stepping = False
        self.steps: list[StepRecord] = []
        self.first_gaps: list[tuple[float, float]] = []  # (first token time, gap to the 2nd token)
        self._just_admitted: list[SimRequest] = []
        self._ranks_waiting: set[int] = set()

    def loads(self) -> list[DecodeLoad]:
        max_requests, capacity = self.max_requests, self.kv_capacity_tokens
        return [
            DecodeLoad(r, running + len(waiting) + incoming, kv + waiting_kv + incoming_kv, max_requests, capacity)
            for r, running, waiting, incoming, kv, waiting_kv, incoming_kv in zip(
                range(self.num_ranks), self.rank2running, self.rank2waiting, self.rank2incoming,
                self.rank2kv, self.rank2waiting_kv, self.rank2incoming_kv,
            )
        ]

    def assign(self, rank: int, req: SimRequest) -> None:
        req.decode_id = rank
        self.rank2incoming[rank] += 1
        self.rank2incoming_kv[rank] += req.num_prompt_tokens

    def unassign(self, rank: int, req: SimRequest) -> None:
        """A request that will not decode (one output token) gives its reservation back."""
        self.rank2incoming[rank] -= 1
        self.rank2incoming_kv[rank] -= req.num_prompt_tokens

    def arrive(self, rank: int, req: SimRequest) -> None:
        self.unassign(rank, req)
        self.rank2waiting[rank].append(req)
        self.rank2waiting_kv[rank] += req.num_prompt_tokens
        self._ranks_waiting.add(rank)

    def begin_step(self, now: float) -> float | None:
        """Admit waiting requests where slots allow, then run one step; returns its end time."""
        num_admitted = 0
        for r in self._ranks_waiting:
            waiting = self.rank2waiting[r]
            while waiting and self.rank2running[r] < self.max_requests and (
                self.rank2kv[r] + waiting[0].num_prompt_tokens <= self.kv_capacity_tokens or self.rank2running[r] == 0
            ):
                req = waiting.popleft()
                self.rank2waiting_kv[r] -= req.num_prompt_tokens
                self.rank2running[r] += 1
                self.rank2kv[r] += req.num_prompt_tokens
                req.decode_admit_step = self.step_idx
                # num_output_tokens - 1 decode steps: admit_step .. admit_step + num_output_tokens - 2
                heapq.heappush(self._finish_heap, (self.step_idx + req.num_output_tokens - 2, req.request_id, req))
                self._just_admitted.append(req)
                num_admitted += 1
        self._ranks_waiting = {r for r in self._ranks_waiting if self.rank2waiting[r]}
        num_running = sum(self.rank2running)
        if num_running == 0:
            self.is_stepping = False
            return None
        self.is_stepping = True
        seconds, balanced = self.cost.step_and_balanced_seconds(self.rank2running, self.rank2kv)
        self.steps.append(StepRecord(now, seconds, balanced, num_running, num_admitted))
        return now + seconds

    def end_step(self, now: float) -> list[SimRequest]:
        """Account the step's tokens; returns the requests that emitted their last token."""
        self.rank2kv = [k + b for k, b in zip(self.rank2kv, self.rank2running)]
        for req in self._just_admitted:
            self.first_gaps.append((req.first_token_s, now - req.first_token_s))
        self._just_admitted.clear()
        done = []
        heap = self._finish_heap
        while heap and heap[0][0] <= self.step_idx:
            req = heapq.heappop(heap)[2]
            r = req.decode_id
            self.rank2running[r] -= 1
            # its KV: the prompt plus one row per decode step (the last sampled token never enters)
            self.rank2kv[r] -= req.num_prompt_tokens + req.num_output_tokens - 1
            req.finish_s = now
            done.append(req)
        self.step_idx += 1
        return done


@dataclass(slots=True)
class VEInstance:
    """A FIFO vision-encoder server; an image costs ``c_image + c_token * tokens`` seconds."""

    engine_id: int
    c_image: float
    c_token: float
    queue: deque = field(default_factory=deque)  # (request, image tokens)
    current: tuple | None = None
    num_pending_tokens: int = 0

    def load(self) -> VELoad:
        return VELoad(self.engine_id, self.num_pending_tokens)

    def enqueue(self, req: SimRequest, num_tokens: int) -> None:
        self.queue.append((req, num_tokens))
        self.num_pending_tokens += num_tokens

    def start_next(self, now: float) -> float | None:
        if self.current is not None or not self.queue:
            return None
        self.current = self.queue.popleft()
        return now + self.c_image + self.c_token * self.current[1]

    def finish(self) -> SimRequest:
        req, num_tokens = self.current
        self.current = None
        self.num_pending_tokens -= num_tokens
        return req
