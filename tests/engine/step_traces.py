"""Step-by-step traces of the engine on seeded random workloads (the refactor's safety net).

A workload is a list of requests with arrival points (after the k-th committed step), aborts,
optional speculative drafts, and an engine shape (pool size, budget, prefix caching, bounded
replay). ``run_workload`` drives one ``EngineCore`` with a fake paged runner through the
engine's step loop (serial, pipelined, or the pipeline stepped one call at a time) and records,
in order:

- every forward the runner saw: per sequence its seq id, slot, block table, positions, token ids,
  logit rows, window_start, write_from;
- every output delta: request id, completion index, token ids, text, finish and stop reasons,
  cached tokens, prompt-logprob / logprob positions (rounded);
- the end state: preemptions, prefix hits, free blocks and slots.

The trace is JSON; ``trace_digest`` hashes it. ``tests/engine/step_traces.json`` holds the digests
recorded before the engine was reorganised; test_step_traces.py checks they never change.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.batch import ForwardBatch
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.sched.scheduler import PLACEHOLDER_TOKEN_ID, SchedulerConfig

NUM_WORKLOADS = 160
VOCAB = 48
EOS = 1
BS = 4
WINDOW = 8
NUM_LAYERS = 2
LOOKAHEAD = 5
RING = WINDOW + LOOKAHEAD
MODES = ("serial", "pipelined", "async")


class RecordingRunner:
    """Stores tokens in the pages and the slot it is given and returns logits hashed from the
    context as read back from them (a wrong table, slot or replay changes every later token);
    records each forward for the trace."""

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        self.pages = np.full((num_blocks, BS), -1, dtype=np.int64)
        self.slot_pos = np.full((num_slots, RING), -1, dtype=np.int64)
        self.slot_tok = np.full((num_slots, RING), -1, dtype=np.int64)
        self.forwards: list[list] = []

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        rows = []
        record = []
        for st in batch.steps:
            assert PLACEHOLDER_TOKEN_ID not in st.token_ids, "placeholder reached the runner"
            record.append([st.seq_id, st.slot, list(st.block_table), st.start_pos, list(st.token_ids),
                           st.num_logits, st.window_start, st.write_from])
            table = np.asarray(st.block_table, dtype=np.int64)
            first_logit = st.num_tokens - st.num_logits
            for i, tok in enumerate(st.token_ids):
                t = st.start_pos + i
                blk, off = table[t // BS], t % BS
                if t >= st.write_from:
                    self.pages[blk, off] = tok
                if t >= st.window_start:
                    self.slot_pos[st.slot, t % RING] = t
                    self.slot_tok[st.slot, t % RING] = tok
                if i >= first_logit:
                    rows.append(self._logits(table, st.slot, t, st.window_start))
        self.forwards.append(record)
        return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, VOCAB)

    def _logits(self, table, slot, t, window_start) -> np.ndarray:
        pos = np.arange(t + 1)
        ctx = self.pages[table[pos // BS], pos % BS]
        wpos = np.arange(max(0, t - WINDOW + 1), t + 1)
        held = self.slot_pos[slot, wpos % RING] == wpos
        win = np.where(held & (wpos >= window_start), self.slot_tok[slot, wpos % RING], -1)
        digest = hashlib.blake2b(ctx.tobytes() + b"|" + win.tobytes(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        logits = (rng.standard_normal(VOCAB) * 2.0).astype(np.float32)
        logits[EOS] += 0.8  # requests end on EOS now and then
        return logits


class CharDetok:
    def step(self, token_id: int) -> str:
        return "" if token_id == EOS else chr(ord("a") + token_id % 13)


@dataclass
class Workload:
    seed: int
    mode: str
    num_blocks: int
    max_num_seqs: int
    budget: int
    prefix_caching: bool
    max_replay_tokens: int | None
    num_spec_tokens: int
    # (arrival after this many committed steps, request id, prompt, params)
    arrivals: list[tuple[int, str, list[int], SamplingParams]] = field(default_factory=list)
    aborts: dict[int, list[str]] = field(default_factory=dict)  # committed steps -> ids


def make_workload(seed: int) -> Workload:
    rng = random.Random(seed)
    mode = MODES[seed % len(MODES)]
    max_num_seqs = rng.choice([2, 4, 8])
    w = Workload(seed, mode, num_blocks=rng.choice([24, 40, 96]), max_num_seqs=max_num_seqs,
                 budget=rng.choice([8, 16, 64, 256]), prefix_caching=rng.random() < 0.8,
                 max_replay_tokens=rng.choice([None, WINDOW * NUM_LAYERS, 6]),
                 num_spec_tokens=rng.choice([0, 0, 3]) if mode == "serial" else 0)
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(4, 30))] for _ in range(3)]
    num = rng.randint(3, 16)
    for i in range(num):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 20))]
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes)[: rng.randint(1, 30)] + prompt
        kind = rng.random()
        common = dict(max_tokens=rng.randint(1, 24), priority=rng.choice([0, 0, 0, 1, 2]),
                      ignore_eos=rng.random() < 0.2)
        if kind < 0.35:
            params = SamplingParams(temperature=0.0, **common)
        elif kind < 0.7:
            params = SamplingParams(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(1 << 30),
                                    top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]),
                                    presence_penalty=rng.choice([0.0, 0.5]),
                                    frequency_penalty=rng.choice([0.0, 0.3]),
                                    repetition_penalty=rng.choice([1.0, 1.2]), **common)
        elif kind < 0.8:
            params = SamplingParams(temperature=0.7, seed=rng.randrange(1 << 30), n=rng.choice([2, 3]), **common)
        elif kind < 0.9:
            params = SamplingParams(temperature=0.0, stop=[rng.choice(["ab", "c", "fg"])],
                                    include_stop_str_in_output=rng.random() < 0.5, **common)
        else:
            params = SamplingParams(temperature=0.0, logprobs=rng.choice([0, 2]),
                                    prompt_logprobs=rng.choice([None, 1]),
                                    min_tokens=min(2, common["max_tokens"]),
                                    stop_token_ids=[rng.randrange(2, VOCAB)], **common)
        w.arrivals.append((rng.randint(0, 40), f"r{i}", prompt, params))
    for _ in range(rng.choice([0, 0, 1, 2])):
        w.aborts.setdefault(rng.randint(1, 40), []).append(f"r{rng.randrange(num)}")
    return w


def make_core(w: Workload) -> EngineCore:
    cfg = EngineCoreConfig(
        scheduler=SchedulerConfig(block_size=BS, max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.budget,
                                  max_model_len=160, enable_prefix_caching=w.prefix_caching,
                                  max_replay_tokens=w.max_replay_tokens, model_id="trace",
                                  max_num_spec_tokens=w.num_spec_tokens),
        num_blocks=w.num_blocks, vocab_size=VOCAB, eos_token_ids=(EOS,))
    return EngineCore(RecordingRunner(w.num_blocks, w.max_num_seqs), cfg,
                      detokenizer_factory=lambda prompt, params: CharDetok(),
                      decode_token=lambda t: chr(ord("a") + t % 13), seed_rng=random.Random(w.seed),
                      clock=lambda: 0.0, step_timer=lambda: 0.0)


def _logprobs(lp):
    if lp is None:
        return None
    return [None if pos is None else sorted((t, round(v.logprob, 3), v.rank, v.decoded_token) for t, v in pos.items())
            for pos in lp]


def _output_record(out) -> list:
    c = out.outputs[0]
    return [out.request_id, c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason, out.finished,
            out.num_cached_tokens, _logprobs(c.logprobs), _logprobs(out.prompt_logprobs)]


class _Feeder:
    """Adds arrivals, aborts and drafts at their committed-step counts (between steps)."""

    def __init__(self, w: Workload, core: EngineCore, trace: dict) -> None:
        self.w, self.core, self.trace = w, core, trace
        self.pending = sorted(w.arrivals, key=lambda a: a[0])
        self.rng = random.Random(w.seed + 1)
        self.done_aborts: set[int] = set()

    def feed(self, *, idle: bool) -> None:
        n = self.core.num_steps
        while self.pending and (self.pending[0][0] <= n or idle):
            _, rid, prompt, params = self.pending.pop(0)
            self.core.add_request(rid, prompt, params)
            idle = False
        for at, ids in self.w.aborts.items():
            if at <= n and at not in self.done_aborts:
                self.done_aborts.add(at)
                self.trace["outputs"].extend(_output_record(o) for o in self.core.abort(ids))
        if self.w.num_spec_tokens:
            for req in self.core.scheduler.running:
                if self.rng.random() < 0.5 and req.num_computed_tokens == req.num_tokens - 1:
                    k = self.rng.randint(1, self.w.num_spec_tokens)
                    req.spec_token_ids = [self.rng.randrange(2, VOCAB) for _ in range(k)]

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)


def _finish(trace: dict, core: EngineCore) -> dict:
    core.check_integrity()
    s = core.scheduler
    trace["forwards"] = core.runner.forwards
    trace["end"] = [s.num_preemptions, s.pool.num_hits, s.pool.num_queries, s.pool.num_free_blocks,
                    s.slots.num_free_slots, len(s.requests), core.num_steps]
    return trace


def run_workload(w: Workload) -> dict:
    """The trace of ``w`` driven by the engine's step loop in ``w.mode``."""
    core = make_core(w)
    trace: dict = {"outputs": []}
    feeder = _Feeder(w, core, trace)
    if w.mode == "pipelined":  # the blocking twin of the engine's step pipeline (tests/bench/sync_steps.py)
        _run_pipelined(core, feeder, trace)
    else:  # the engine's StepLoop, serial or pipelined
        asyncio.run(_run_step_loop(core, feeder, trace, is_pipelined=w.mode == "async"))
    return _finish(trace, core)


def _raise(request_ids, error):
    raise error


async def _run_step_loop(core: EngineCore, feeder: _Feeder, trace: dict, *, is_pipelined: bool) -> None:
    """The engine's own StepLoop; arrivals, aborts and drafts come in between steps (its deliver hook)."""
    from concurrent.futures import ThreadPoolExecutor

    from deepinfer.engine.core.step_loop import FailurePolicy, FailureScope, StepHooks, StepLoop

    with ThreadPoolExecutor(1) as ex:
        def deliver(outputs) -> None:
            trace["outputs"].extend(_output_record(o) for o in outputs)
            if not is_pipelined:
                core.check_integrity()
            feed()

        def feed() -> None:
            feeder.feed(idle=not steps.has_work())
            while not steps.has_work() and feeder.has_pending:  # aborts emptied it: as the next step's feed
                feeder.feed(idle=True)
            if not steps.has_work():
                steps.close()

        steps = StepLoop(core, ex, StepHooks(deliver=deliver, fail=_raise), name="trace", is_pipelined=is_pipelined,
                         failure=FailurePolicy(FailureScope.HELD))
        feed()
        await asyncio.wait_for(steps.run(), 120)


def _run_pipelined(core: EngineCore, feeder: _Feeder, trace: dict) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tests.conftest import load_test_helper

    sync_steps = load_test_helper("bench/sync_steps")
    with ThreadPoolExecutor(1) as ex:
        pipe = sync_steps.StepPipeline(core, ex)
        for _ in range(5000):
            feeder.feed(idle=not pipe.has_work())
            if not pipe.has_work() and not feeder.has_pending:
                return
            trace["outputs"].extend(_output_record(o) for o in pipe.step())
    raise AssertionError("the engine did not finish")


def trace_digest(trace: dict) -> str:
    return hashlib.sha256(json.dumps(trace, sort_keys=True).encode()).hexdigest()


def all_digests(num: int = NUM_WORKLOADS) -> dict[str, str]:
    return {str(seed): trace_digest(run_workload(make_workload(seed))) for seed in range(num)}


if __name__ == "__main__":  # record: python tests/engine/step_traces.py OUT.json [FULL.json]
    import sys

    traces = {str(seed): run_workload(make_workload(seed)) for seed in range(NUM_WORKLOADS)}
    digests = {k: trace_digest(v) for k, v in traces.items()}
    with open(sys.argv[1], "w") as f:
        json.dump(digests, f, indent=0, sort_keys=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(traces, f, sort_keys=True)
