"""EngineCore against a fake paged runner that really stores tokens in the block table and the SWA
slot: logits are a hash of the context *as read back from the pages and the slot*, so a wrong
block table, a shared block with different contents, a slot used by two sequences or a missing
replay changes the outputs and the per-request comparison fails."""

from __future__ import annotations

import hashlib
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.batch import ForwardBatch
from deepinfer.engine.core.engine_core import EngineCore, EngineCoreConfig
from deepinfer.engine.sched.scheduler import PLACEHOLDER_TOKEN_ID, SchedulerConfig
from deepinfer.engine.text.output_processor import merge_output
from tests.conftest import load_test_helper

sync_steps = load_test_helper("bench/sync_steps")

VOCAB = 64
EOS = 1
BS = 4
WINDOW = 8
NUM_LAYERS = 2
LOOKAHEAD = 5  # slot rows beyond the window: speculative positions that may be rolled back
RING = WINDOW + LOOKAHEAD


class FakePagedRunner:
    def __init__(self, num_blocks: int, num_slots: int) -> None:
        self.pages = np.full((num_blocks, BS), -1, dtype=np.int64)
        self.slot_pos = np.full((num_slots, RING), -1, dtype=np.int64)
        self.slot_tok = np.full((num_slots, RING), -1, dtype=np.int64)
        self.num_replayed = 0
        self.num_steps = 0
        self.max_tokens_per_step = 0

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        rows = []
        self.num_steps += 1
        self.max_tokens_per_step = max(self.max_tokens_per_step, batch.num_tokens)
        slots = [s.slot for s in batch.steps]
        assert len(set(slots)) == len(slots), "two sequences share a slot in one step"
        for st in batch.steps:
            assert PLACEHOLDER_TOKEN_ID not in st.token_ids, "placeholder reached the runner"
            table = np.asarray(st.block_table, dtype=np.int64)
            first_logit = st.num_tokens - st.num_logits
            for i, tok in enumerate(st.token_ids):
                t = st.start_pos + i
                blk, off = table[t // BS], t % BS
                if t >= st.write_from:
                    self.pages[blk, off] = tok
                else:  # replay over a prefix hit: the cached block must already hold this token
                    assert self.pages[blk, off] == tok, "prefix-cache block holds other tokens"
                    self.num_replayed += 1
                if t >= st.window_start:
                    self.slot_pos[st.slot, t % RING] = t
                    self.slot_tok[st.slot, t % RING] = tok
                if i >= first_logit:
                    rows.append(self._logits(table, st.slot, t, st.window_start))
        return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, VOCAB)

    def _logits(self, table, slot, t, window_start) -> np.ndarray:
        pos = np.arange(t + 1)
        ctx = self.pages[table[pos // BS], pos % BS]
        assert np.all(ctx >= 0), "read an unwritten block row"
        # the window as the slot holds it; a row of another position reads as absent (-1)
        wpos = np.arange(max(0, t - WINDOW + 1), t + 1)
        held = self.slot_pos[slot, wpos % RING] == wpos
        win = np.where(held & (wpos >= window_start), self.slot_tok[slot, wpos % RING], -1)
        digest = hashlib.blake2b(ctx.tobytes() + b"|" + win.tobytes(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        return (rng.standard_normal(VOCAB) * 2.0).astype(np.float32)


def make_core(num_blocks=512, max_num_seqs=16, budget=64, prefix_caching=True, spec=0):
    cfg = EngineCoreConfig(
        scheduler=SchedulerConfig(
            block_size=BS, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256,
            enable_prefix_caching=prefix_caching, max_replay_tokens=WINDOW * NUM_LAYERS, model_id="fake",
            max_num_spec_tokens=spec,
        ),
        num_blocks=num_blocks,
        vocab_size=VOCAB,
        eos_token_ids=(EOS,),
    )
    return EngineCore(FakePagedRunner(num_blocks, max_num_seqs), cfg, seed_rng=random.Random(0))


def make_workload(num=64, seed=0):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(8, 40))] for _ in range(4)]
    reqs = []
    for i in range(num):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.6:
            prompt = prefixes[rng.randrange(4)] + prompt
        if i % 2 == 0:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40))
        else:
            params = SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=rng.randint(1, 40),
                                    top_k=rng.choice([0, 20]), presence_penalty=rng.choice([0.0, 0.5]))
        reqs.append((f"r{i}", prompt, params, rng.randint(0, 60)))  # arrival step
    return reqs


def run_alone(reqs):
    ref = {}
    for rid, prompt, params, _ in reqs:
        core = make_core(budget=4096)
        core.add_request(rid, prompt, params)
        acc = None
        while core.has_unfinished_requests():
            for out in sync_steps.step(core):
                acc = merge_output(acc, out)
        ref[rid] = (acc.outputs[0].token_ids, acc.outputs[0].finish_reason)
    return ref


@pytest.fixture(scope="module")
def workload():
    reqs = make_workload()
    return reqs, run_alone(reqs)


def run_concurrent(core, reqs, step_fn, abort_ids=(), drafts=None, has_work=None):
    results: dict[str, object] = {}
    pending = sorted(reqs, key=lambda r: r[3])
    step_no = 0
    aborted = set()
    has_work = has_work or core.has_unfinished_requests
    while pending or has_work():
        while pending and pending[0][3] <= step_no:
            rid, prompt, params, _ = pending.pop(0)
            core.add_request(rid, prompt, params)
        if step_no == 30 and abort_ids:
            for out in core.abort(abort_ids):
                results[out.request_id] = merge_output(results.get(out.request_id), out)
            aborted.update(abort_ids)
        if drafts is not None:
            drafts(core)
        for out in step_fn():
            results[out.request_id] = merge_output(results.get(out.request_id), out)
        core.check_integrity()
        step_no += 1
        assert step_no < 5000, "engine did not finish"
    return results, aborted


def assert_same_as_alone(results, ref, aborted=()):
    for rid, (tokens, reason) in ref.items():
        if rid in aborted:
            continue
        out = results[rid].outputs[0]
        assert out.token_ids == tokens, f"{rid}: {out.token_ids} != alone {tokens}"
        assert out.finish_reason == reason


def assert_all_freed(core):
    s = core.scheduler
    assert not s.requests and not s.running and len(s.waiting) == 0
    assert s.pool.num_free_blocks == s.pool.num_blocks
    assert s.slots.num_free_slots == s.slots.num_slots
    core.check_integrity()


def test_concurrent_outputs_equal_alone_outputs(workload):
    reqs, ref = workload
    core = make_core(num_blocks=48, max_num_seqs=16, budget=64)
    abort_ids = ["r3", "r10", "r11"]
    results, aborted = run_concurrent(core, reqs, (lambda: sync_steps.step(core)), abort_ids=abort_ids)
    assert_same_as_alone(results, ref, aborted)
    for rid in abort_ids:
        if rid in results:
            assert results[rid].outputs[0].finish_reason in ("abort", ref[rid][1])
    s = core.scheduler
    assert s.num_preemptions > 0, "pool was meant to be small enough to preempt"
    assert s.pool.num_hits > 0 and core.runner.num_replayed > 0, "prefix hits with replay expected"
    assert core.runner.max_tokens_per_step <= 64
    assert_all_freed(core)
    assert any(r.num_cached_tokens > 0 for r in results.values())


def test_pipelined_outputs_equal_alone_outputs(workload):
    reqs, ref = workload
    core = make_core(num_blocks=48, max_num_seqs=16, budget=64)
    with ThreadPoolExecutor(1) as ex:
        pipe = sync_steps.StepPipeline(core, ex)
        results, aborted = run_concurrent(core, reqs, pipe.step, abort_ids=["r5"], has_work=pipe.has_work)
    assert_same_as_alone(results, ref, aborted)
    assert core.scheduler.num_preemptions > 0
    assert_all_freed(core)


def test_speculative_drafts_do_not_change_outputs(workload):
    reqs, ref = workload
    core = make_core(num_blocks=64, max_num_seqs=16, budget=64, spec=4)
    rng = random.Random(5)
    ref_tokens = {rid: toks for rid, (toks, _) in ref.items()}

    def propose(core):
        # drafts: the true continuation with random corruptions (some accepted, some rejected)
        for req in core.scheduler.running:
            done = req.num_output_tokens
            if req.num_computed_tokens == req.num_tokens - 1 and req.num_output_placeholders == 0 and done:
                true = ref_tokens[req.request_id][done : done + 4]
                req.spec_token_ids = [t if rng.random() < 0.7 else rng.randrange(VOCAB) for t in true]

    results, _ = run_concurrent(core, reqs, (lambda: sync_steps.step(core)), drafts=propose)
    assert_same_as_alone(results, ref)
    assert_all_freed(core)
    plain = make_core(num_blocks=64, max_num_seqs=16, budget=64)
    run_concurrent(plain, reqs, (lambda: sync_steps.step(plain)))
    assert core.num_steps < plain.num_steps  # accepted drafts save steps


def test_prefix_hit_outputs_identical_and_reported():
    core = make_core()
    prompt = list(range(2, 40))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = {}
    for rid in ("first", "second"):
        core.add_request(rid, prompt, params)
        while core.has_unfinished_requests():
            for o in sync_steps.step(core):
                outs[rid] = merge_output(outs.get(rid), o)
    assert outs["first"].outputs[0].token_ids == outs["second"].outputs[0].token_ids
    assert outs["first"].num_cached_tokens == 0
    assert outs["second"].num_cached_tokens == 36  # 9 full blocks of the 38-token prompt
    events = core.drain_kv_events()
    assert events and core.drain_kv_events() == []


def test_parallel_sampling_n_and_logprobs():
    core = make_core()
    core.add_request("p", [5, 6, 7], SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=5, logprobs=2,
                                                     prompt_logprobs=1))
    acc = None
    while core.has_unfinished_requests():
        for o in sync_steps.step(core):
            acc = merge_output(acc, o)
    assert acc.finished and [c.index for c in acc.outputs] == [0, 1, 2]
    for c in acc.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, pos in zip(c.token_ids, c.logprobs):
            assert tok in pos and 2 <= len(pos) <= 3
        assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))
    assert acc.prompt_logprobs[0] is None and len(acc.prompt_logprobs) == 3
    assert 6 in acc.prompt_logprobs[1] and 7 in acc.prompt_logprobs[2]
    # child i uses seed + i: completion 1 equals a lone request with seed 12
    lone = make_core()
    lone.add_request("x", [5, 6, 7], SamplingParams(temperature=0.8, seed=12, max_tokens=5))
    got = None
    while lone.has_unfinished_requests():
        for o in sync_steps.step(lone):
            got = merge_output(got, o)
    assert got.outputs[0].token_ids == acc.outputs[1].token_ids


def test_bad_input_is_a_one_line_error():
    core = make_core()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add_request("a", [VOCAB + 3], SamplingParams())
    with pytest.raises(ValueError, match="tokenizer"):
        core.add_request("b", [3], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="structured_outputs"):
        core.add_request("c", [3], SamplingParams(structured_outputs={"regex": "a+"}))


class EosHeavyRunner:
    """Logits that always prefer EOS, then token 5, then token 7."""

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        logits = torch.zeros(batch.num_logits, VOCAB)
        logits[:, EOS], logits[:, 5], logits[:, 7] = 10.0, 9.0, 8.0
        return logits


class CharDetok:
    def step(self, token_id: int) -> str:
        return "" if token_id == EOS else chr(ord("a") + token_id % 26)


def eos_core(**kw):
    cfg = EngineCoreConfig(SchedulerConfig(block_size=BS, max_num_seqs=4), num_blocks=64, vocab_size=VOCAB,
                           eos_token_ids=(EOS,))
    return EngineCore(EosHeavyRunner(), cfg, detokenizer_factory=lambda p, s: CharDetok(), **kw)


def drive(core):
    acc = {}
    while core.has_unfinished_requests():
        for o in sync_steps.step(core):
            acc[o.request_id] = merge_output(acc.get(o.request_id), o)
        core.check_integrity()
    return acc


def test_min_tokens_stop_ids_ignore_eos_and_stop_strings():
    core = eos_core()
    core.add_request("eos", [3, 4], SamplingParams(temperature=0.0, max_tokens=5))
    core.add_request("min", [3, 4], SamplingParams(temperature=0.0, max_tokens=5, min_tokens=3))
    core.add_request("ignore", [3, 4], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    core.add_request("stopid", [3, 4], SamplingParams(temperature=0.0, max_tokens=5, min_tokens=1, stop_token_ids=[5]))
    acc = drive(core)
    out = {k: v.outputs[0] for k, v in acc.items()}
    assert (out["eos"].token_ids, out["eos"].finish_reason) == ([EOS], "stop")
    # EOS masked for the first 3 outputs (vLLM's min_tokens): the best other token is 5
    assert out["min"].token_ids == [5, 5, 5, EOS] and out["min"].finish_reason == "stop"
    assert out["ignore"].token_ids == [EOS] * 3 and out["ignore"].finish_reason == "length"
    # min_tokens=1 masks EOS and the stop id 5 for the first token (-> 7); then EOS wins
    assert out["stopid"].token_ids == [7, EOS]
    s = core.scheduler
    assert s.pool.num_free_blocks == s.pool.num_blocks and s.slots.num_free_slots == 4


def test_stop_string_finishes_and_frees_the_request():
    class NoEosRunner(EosHeavyRunner):
        def execute(self, batch):
            logits = super().execute(batch)
            logits[:, EOS] = -10.0
            return logits

    core = eos_core()
    core.runner = NoEosRunner()
    # token 5 -> "f": the text is "fff..."; stop at "ff"
    core.add_request("s", [3, 4], SamplingParams(temperature=0.0, max_tokens=20, stop=["ff"]))
    core.add_request("keep", [3, 4], SamplingParams(temperature=0.0, max_tokens=4, stop=["ff"],
                                                     include_stop_str_in_output=True))
    acc = drive(core)
    assert (acc["s"].outputs[0].text, acc["s"].outputs[0].token_ids) == ("", [5, 5])
    assert (acc["s"].outputs[0].finish_reason, acc["s"].outputs[0].stop_reason) == ("stop", "ff")
    assert acc["keep"].outputs[0].text == "ff"
    assert not core.scheduler.requests and core.scheduler.slots.num_free_slots == 4
