"""Workload traces: chat and agent sessions sharing prefixes, bursty arrivals, heavy-tailed prompts.

A trace is a list of sessions. A session has a shared prefix (a system prompt, or an agent
scaffold of instructions + tool schemas, drawn Zipf-popular from a small pool) and turns. Turn k's
prompt is the previous turn's prompt + the previous reply + the turn's new tokens, so every turn
extends the last one and a prefix cache holding turn k-1's prompt serves most of turn k:

    turn 0:  [ shared prefix | new_0 ]
    turn 1:  [ shared prefix | new_0 | out_0 | new_1 ]
    turn 2:  [ shared prefix | new_0 | out_0 | new_1 | out_1 | new_2 ]

Turn k+1 is sent ``think_s`` after turn k's reply is complete (a user reads, a tool runs), so the
timeline of later turns depends on the serving system; everything else (sessions, start times,
token counts, think times) is fixed by the seed, and every policy replays the same trace.

Block hashes are ints: blocks wholly inside the shared prefix hash by (prefix id, block index) and
are shared across sessions; every later block is unique to its session (in a hash chain a block's
hash covers everything before it).

The session arrival rate is solved from the target prefill load (see ``WorkloadConfig``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from deepinfer.runtime.balance.cost_model import PrefillCost

_BLOCKS_PER_OWNER = 1 << 24  # block-index space per session / prefix (8G tokens at 512 per block)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Defaults model a mixed chatbot + coding-agent service (reasons in bench_balance's docstring)."""

    duration_s: float = 480.0
    warmup_s: float = 120.0
    prefill_load: float = 0.8  # ideal-reuse prefill compute / prefill pool capacity
    agent_session_share: float = 0.15
    block_size: int = 512
    max_context_tokens: int = 1 << 20
    # bursty arrivals: a Markov-modulated Poisson process around the mean rate
    burst_factor: float = 1.5
    burst_time_share: float = 0.2
    burst_mean_s: float = 20.0
    # chat
    num_chat_prefixes: int = 200
    chat_prefix_median: int = 1500
    chat_first_median: int = 400
    chat_doc_prob: float = 0.04
    chat_doc_median: int = 24_000
    chat_doc_sigma: float = 1.4
    chat_followup_median: int = 150
    chat_turns_mean: float = 3.5
    chat_think_median_s: float = 25.0
    chat_output_median: int = 600
    chat_image_prob: float = 0.10
    # agent
    num_agent_prefixes: int = 8
    agent_prefix_median: int = 12_000
    agent_task_median: int = 4000
    agent_tool_median: int = 1500
    agent_turns_mean: float = 25.0
    agent_think_median_s: float = 3.0
    agent_output_median: int = 350

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"need 0 <= warmup_s < duration_s, got {self.warmup_s} and {self.duration_s}")
        if not 0 < self.prefill_load:
            raise ValueError(f"prefill_load must be > 0, got {self.prefill_load}")
        if not 0 <= self.agent_session_share <= 1:
            raise ValueError(f"agent_session_share must be in [0, 1], got {self.agent_session_share}")
        if self.burst_factor * self.burst_time_share >= 1:
            raise ValueError("burst_factor * burst_time_share must be < 1 so calm periods keep a positive rate")


@dataclass(slots=True)
class Turn:
    new_tokens: int  # appended before this turn's prompt (user message, tool result, images)
    output_tokens: int
    think_s: float  # delay after the previous turn's reply (0 for the first turn)
    image_tokens: tuple[int, ...] = ()


@dataclass(slots=True)
class Session:
    session_id: int
    is_agent: bool
    start_s: float
    prefix_id: int
    prefix_tokens: int
    turns: list[Turn] = field(default_factory=list)

    def prompt_tokens(self, k: int) -> int:
        turns = self.turns
        return self.prefix_tokens + sum(t.new_tokens for t in turns[: k + 1]) + sum(t.output_tokens for t in turns[:k])

    def block_hashes(self, num_prompt_tokens: int, block_size: int) -> list[int]:
        num_blocks = num_prompt_tokens // block_size
        num_shared = min(num_blocks, self.prefix_tokens // block_size)
        shared_base = -(self.prefix_id + 1) * _BLOCKS_PER_OWNER
        own_base = self.session_id * _BLOCKS_PER_OWNER
        return [shared_base - i for i in range(num_shared)] + [own_base + i for i in range(num_shared, num_blocks)]


@dataclass(slots=True)
class Trace:
    config: WorkloadConfig
    sessions: list[Session]
    session_rate: float  # mean session starts per second
    seed: int


def _lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> int:
    return int(min(high, max(low, median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def _geometric_extra(rng: random.Random, mean_extra: float) -> int:
    """Number of failures before a success with mean ``mean_extra`` (0 when mean_extra <= 0)."""
    if mean_extra <= 0:
        return 0
    p = 1.0 / (1.0 + mean_extra)
    return int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


class _SessionFactory:
    """Draws session contents (no start time) from one RNG stream, in order."""

    def __init__(self, cfg: WorkloadConfig, rng: random.Random):
        self.cfg = cfg
        self.rng = rng
        self.chat_prefix2tokens = [
            _lognormal(rng, cfg.chat_prefix_median, 0.8, 200, 8000) for _ in range(cfg.num_chat_prefixes)
        ]
        self.agent_prefix2tokens = [
            _lognormal(rng, cfg.agent_prefix_median, 0.4, 4000, 32_000) for _ in range(cfg.num_agent_prefixes)
        ]
        self.chat_zipf = _zipf_weights(cfg.num_chat_prefixes, 1.1)
        self.agent_zipf = _zipf_weights(cfg.num_agent_prefixes, 1.1)
        self.num_made = 0

    def make(self) -> Session:
        cfg, rng = self.cfg, self.rng
        sid = self.num_made
        self.num_made += 1
        if rng.random() < cfg.agent_session_share:
            k = rng.choices(range(cfg.num_agent_prefixes), self.agent_zipf)[0]
            session = Session(sid, True, 0.0, cfg.num_chat_prefixes + k, self.agent_prefix2tokens[k])
            num_turns = 5 + _geometric_extra(rng, cfg.agent_turns_mean - 5)
            for i in range(num_turns):
                if i == 0:
                    new = _lognormal(rng, cfg.agent_task_median, 1.2, 50, 200_000)
                else:
                    new = _lognormal(rng, cfg.agent_tool_median, 1.2, 20, 64_000)
                out = _lognormal(rng, cfg.agent_output_median, 0.9, 8, 8000)
                think = 0.0 if i == 0 else _lognormal(rng, cfg.agent_think_median_s, 1.0, 0.2, 120.0)
                if not self._append(session, Turn(new, out, think)):
                    break
        else:
            k = rng.choices(range(cfg.num_chat_prefixes), self.chat_zipf)[0]
            session = Session(sid, False, 0.0, k, self.chat_prefix2tokens[k])
            num_turns = 1 + _geometric_extra(rng, cfg.chat_turns_mean - 1)
            for i in range(num_turns):
                if i == 0:
                    new = _lognormal(rng, cfg.chat_first_median, 1.0, 5, 32_000)
                    if rng.random() < cfg.chat_doc_prob:
                        new += _lognormal(rng, cfg.chat_doc_median, cfg.chat_doc_sigma, 2000, cfg.max_context_tokens)
                else:
                    new = _lognormal(rng, cfg.chat_followup_median, 1.0, 2, 16_000)
                images: tuple[int, ...] = ()
                if rng.random() < cfg.chat_image_prob:
                    images = tuple(rng.randint(256, 1024) for _ in range(rng.randint(1, 4)))
                out = _lognormal(rng, cfg.chat_output_median, 0.9, 16, 16_000)
                think = 0.0 if i == 0 else _lognormal(rng, cfg.chat_think_median_s, 0.8, 2.0, 600.0)
                if not self._append(session, Turn(new + sum(images), out, think, images)):
                    break
        return session

    def _append(self, session: Session, turn: Turn) -> bool:
        """Add a turn unless its context would pass the model's limit (the session ends there)."""
        session.turns.append(turn)
        k = len(session.turns) - 1
        if session.prompt_tokens(k) + turn.output_tokens > self.cfg.max_context_tokens:
            session.turns.pop()
            if not session.turns:  # a first prompt past the limit is cut to fit (clients truncate)
                room = self.cfg.max_context_tokens - session.prefix_tokens - turn.output_tokens
                session.turns.append(Turn(room, turn.output_tokens, 0.0, turn.image_tokens))
            return False
        return True


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def ideal_prefill_seconds(session: Session, block_size: int, cost: PrefillCost) -> float:
    """Prefill compute of a session if every turn found the previous turn's prompt cached (and the
    first turn its shared prefix): the reuse an infinite cache with perfect affinity would give."""
    total = 0.0
    cached = (session.prefix_tokens // block_size) * block_size
    for k in range(len(session.turns)):
        num_tokens = session.prompt_tokens(k)
        hit = min(cached, num_tokens - 1)
        total += cost.seconds(num_tokens - hit, hit)
        cached = (num_tokens // block_size) * block_size
    return total


def _burst_schedule(cfg: WorkloadConfig, rng: random.Random) -> list[tuple[float, float]]:
    """(start, rate multiplier) phases alternating calm / burst, mean multiplier 1."""
    calm = (1.0 - cfg.burst_factor * cfg.burst_time_share) / (1.0 - cfg.burst_time_share)
    calm_mean_s = cfg.burst_mean_s * (1.0 - cfg.burst_time_share) / max(cfg.burst_time_share, 1e-9)
    phases, t, is_burst = [], 0.0, False
    while t < cfg.duration_s:
        phases.append((t, cfg.burst_factor if is_burst else calm))
        t += rng.expovariate(1.0 / (cfg.burst_mean_s if is_burst else calm_mean_s))
        is_burst = not is_burst and cfg.burst_time_share > 0
    return phases


def generate_trace(cfg: WorkloadConfig, num_prefill_engines: int, cost: PrefillCost, seed: int,
                   num_calibration_sessions: int = 4000) -> Trace:
    """Sessions with start times over ``[0, duration_s)`` whose ideal prefill demand is
    ``prefill_load`` of ``num_prefill_engines`` engines' capacity on average."""
    factory = _SessionFactory(cfg, random.Random(seed * 7919 + 1))
    sessions = [factory.make() for _ in range(num_calibration_sessions)]
    mean_demand_s = sum(ideal_prefill_seconds(s, cfg.block_size, cost) for s in sessions) / len(sessions)
    rate = cfg.prefill_load * num_prefill_engines / mean_demand_s
    arrivals = random.Random(seed * 7919 + 2)
    phases = _burst_schedule(cfg, arrivals)
    peak = max(mult for _, mult in phases)
    # thinning: candidates at the peak rate, each kept with probability rate(t) / peak
    t, phase, used = 0.0, 0, 0
    while True:
        t += arrivals.expovariate(rate * peak)
        if t >= cfg.duration_s:
            break
        while phase + 1 < len(phases) and phases[phase + 1][0] <= t:
            phase += 1
        if arrivals.random() * peak > phases[phase][1]:
            continue
        if used == len(sessions):
            sessions.append(factory.make())
        sessions[used].start_s = t
        used += 1
    return Trace(cfg, sessions[:used], rate, seed)
