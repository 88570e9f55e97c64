"""``deepinfer bench spec`` on a real model: the engine with DSpark off, fixed-5 and confidence-scheduled.

One ``LLM`` per mode (max_num_seqs = the largest concurrency; DSpark's SPS table is measured at
its start-up, as serving does), the same requests in every mode: at concurrency C, C held-out
function headers (the checkpoint's ``heldout_headers.json``, cycled) decoded greedily for
``max_tokens`` tokens each, ignoring EOS, all submitted at once. Per mode and C:

    tok_s       generated tokens / wall time of the C requests (their prefill included, the same
                prompts in every mode)
    tok_cpu_s   generated tokens / CPU seconds this process spent on them (every thread): on a
                machine shared with other work the wall time carries their load, CPU time far
                less (torch's threads spin while waiting, so it is an upper bound on cost)
    ver         drafts verified per request and decode step (SpecStats.num_verified /
                num_request_steps; fixed: 5 less the cap near max_tokens)
    acc         tokens committed per request and decode step, the target's own included
                (1 + num_accepted / num_request_steps; off: 1)
    identical   every request's tokens equal no speculation's

Modes run in turn at each C (off, fixed, confidence), ``repeats`` times, keeping each one's best
wall time and best CPU time: the machine's load only ever adds time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from deepinfer import LLM, SamplingParams

MODES = {"off": {}, "fixed": dict(speculative="dspark", spec_schedule="fixed"),
         "sched": dict(speculative="dspark", spec_schedule="confidence")}


@dataclass(slots=True)
class ModeResult:
    tok_s: float = 0.0
    tok_cpu_s: float = 0.0
    verified_per_step: float = 0.0
    accepted_len: float = 1.0
    tokens: list | None = None
    draft_seconds: float = 0.0


def prompts_of(model_dir: Path, count: int) -> list[str]:
    path = Path(model_dir) / "heldout_headers.json"
    headers = [h["header"] for h in json.loads(path.read_text())] if path.is_file() else ["def main():\n"]
    return [headers[i % len(headers)] for i in range(count)]


def start_engines(model_dir: Path, max_seqs: int, *, max_model_len: int, num_threads: int | None,
                  num_draft_tokens: int) -> dict[str, LLM]:
    engines = {}
    for name, spec in MODES.items():
        kw = dict(spec, num_draft_tokens=num_draft_tokens) if spec else {}
        engines[name] = LLM(str(model_dir), max_num_seqs=max_seqs, block_size=16, max_model_len=max_model_len,
                            num_threads=num_threads, seed=0, **kw)
    return engines


def run_concurrency(engines: dict[str, LLM], prompts: list[str], max_tokens: int, repeats: int) -> dict[str, ModeResult]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    best: dict[str, ModeResult] = {}
    for _ in range(repeats):
        for name, llm in engines.items():
            spec = llm.engine.core.spec
            before = replace(spec.stats) if spec is not None else None
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params)
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
            if name not in best:
                best[name] = res
            elif res.tok_s > best[name].tok_s:
                res.tok_cpu_s = max(res.tok_cpu_s, best[name].tok_cpu_s)
                best[name] = res
            else:
                best[name].tok_cpu_s = max(res.tok_cpu_s, best[name].tok_cpu_s)
    return best


def warm_up(engines: dict[str, LLM], prompts: list[str]) -> None:
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
