"""``deepinfer bench spec`` on a real model: the engine with DSpark off, fixed-5 and confidence-scheduled.

One ``LLM`` per mode (max_num_seqs = the largest concurrency; DSpark's SPS table is measured at
its start-up, as serving does), the same requests in every mode: at concurrency C, C held-out
function headers (the checkpoint's ``heldout_headers.json``, cycled) decoded greedily for
``max_tokens`` tokens each, ignoring EOS, all submitted at once; with several waves, each wave's
C requests (the next C headers) once the last wave's are done. Per mode and C:

    tok_s       generated tokens / wall time of the C requests of every wave (their prefill
                included, the same prompts in every mode)
    tok_cpu_s   generated tokens / CPU seconds this process spent on them (every thread): on a
                machine shared with other work the wall time carries their load, CPU time far
                less (torch's threads spin while waiting, so it is an upper bound on cost)
    ver         drafts verified per request and decode step (SpecStats.num_verified /
                num_request_steps; fixed: 5 less the cap near max_tokens)
    acc         tokens committed per request and decode step, the target's own included
                (1 + num_accepted / num_request_steps; off: 1)
    identical   every request's tokens equal no speculation's

Fair on a noisy machine: at each C the modes run interleaved, ``repeats`` rounds, each round in
a rotated order (off, fixed, sched / fixed, sched, off / ...), so a burst of load from another job
falls on every mode alike; the same prompts every time. Each figure is the median over the rounds,
with its spread ``(max - min) / median``; ``*_vs_*`` ratios are medians of the per-round ratios
(both modes measured within a minute of each other).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from deepinfer import LLM, SamplingParams

MODES = {"off": {}, "fixed": dict(speculative="dspark", spec_schedule="fixed"),
         "sched": dict(speculative="dspark", spec_schedule="confidence")}
EXTRA_MODES = {"throughput": dict(speculative="dspark", spec_schedule="throughput")}


@dataclass(slots=True)
class ModeResult:
    tok_s: float = 0.0
    tok_cpu_s: float = 0.0
    verified_per_step: float = 0.0
    accepted_len: float = 1.0
    tokens: list | None = None
    draft_seconds: float = 0.0
    tok_s_spread: float = 0.0  # (max - min) / median of tok_s over the rounds
    rounds: list | None = None  # tok_s of each round


def prompts_of(model_dir: Path, count: int) -> list[str]:
    path = Path(model_dir) / "heldout_headers.json"
    headers = [h["header"] for h in json.loads(path.read_text())] if path.is_file() else ["def main():\n"]
    return [headers[i % len(headers)] for i in range(count)]


def start_engines(model_dir: Path, max_seqs: int, *, max_model_len: int, num_threads: int | None,
                  num_draft_tokens: int, modes=MODES, dtype: str = "auto",
                  batch_invariant: bool | None = None) -> dict[str, LLM]:
    engines = {}
    for name, spec in modes.items():
        kw = dict(spec, num_draft_tokens=num_draft_tokens) if spec else {}
        engines[name] = LLM(str(model_dir), max_num_seqs=max_seqs, block_size=16, max_model_len=max_model_len,
                            num_threads=num_threads, seed=0, dtype=dtype, batch_invariant=batch_invariant, **kw)
    return engines


def graph_stats(llm: LLM) -> dict[str, int] | None:
    """The engine's CUDA-graph counters (replays, captures, eager forwards, failed captures; the
    drafter's pass as ``draft_*``), or None without graphs (CPU)."""
    graphs = getattr(llm.engine.core.runner, "graphs", None)
    if graphs is None:
        return None
    st = graphs.stats
    out = dict(replays=st.replays, captures=st.captures, eager=st.eager, failed=st.failed)
    spec = llm.engine.core.spec
    drafts = spec.proposer.graphs if spec is not None else None
    if drafts is not None:  # the drafter's pass (engine/spec/graphed_proposals.py)
        d = drafts.stats
        out.update(draft_replays=d.replays, draft_captures=d.captures, draft_eager=d.eager, draft_failed=d.failed)
    return out


def _run_once(llm: LLM, waves: list[list[str]], params: SamplingParams) -> ModeResult:
    spec = llm.engine.core.spec
    before = replace(spec.stats) if spec is not None else None
    t0, c0 = time.perf_counter(), time.process_time()
    outs = [o for prompts in waves for o in llm.generate(prompts, params)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = [o.outputs[0].token_ids for o in outs]
    num = sum(map(len, tokens))
    res = ModeResult(tok_s=num / wall, tok_cpu_s=num / max(cpu, 1e-9), tokens=tokens)
    if spec is not None:
        st = spec.stats
        steps = st.num_request_steps - before.num_request_steps
        if steps:
            res.verified_per_step = (st.num_verified - before.num_verified) / steps
            res.accepted_len = 1 + (st.num_accepted - before.num_accepted) / steps
        res.draft_seconds = st.draft_seconds - before.draft_seconds
    return res


def run_concurrency(engines: dict[str, LLM], waves: list[list[str]], max_tokens: int, repeats: int
                    ) -> tuple[dict[str, ModeResult], dict[tuple[str, str], float]]:
    """Interleaved rounds (module docstring) over ``waves`` (lists of prompts sent together, one
    after another). Returns per mode its median figures, and per pair (a, b) the median over
    rounds of tok_s(a) / tok_s(b)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    names = list(engines)
    runs: dict[str, list[ModeResult]] = {n: [] for n in names}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            runs[name].append(_run_once(engines[name], waves, params))
    out = {}
    for name, rs in runs.items():
        tok_s = [r.tok_s for r in rs]
        med = statistics.median(tok_s)
        out[name] = ModeResult(tok_s=med, tok_cpu_s=statistics.median(r.tok_cpu_s for r in rs),
                               verified_per_step=statistics.median(r.verified_per_step for r in rs),
                               accepted_len=statistics.median(r.accepted_len for r in rs),
                               tokens=rs[0].tokens if all(r.tokens == rs[0].tokens for r in rs) else None,
                               draft_seconds=statistics.median(r.draft_seconds for r in rs),
                               tok_s_spread=(max(tok_s) - min(tok_s)) / med, rounds=tok_s)
    ratios = {(a, b): statistics.median(x.tok_s / y.tok_s for x, y in zip(runs[a], runs[b]))
              for a in names for b in names if a != b}
    return out, ratios


def warm_up(engines: dict[str, LLM], prompts: list[str]) -> None:
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
