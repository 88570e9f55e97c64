"""The decode engine's pipelined step loop (runtime/disagg/engine_loop.py) on real tiny
DeepSeek-V4 cores in one process: handoffs prefilled on one core are imported into a decode
core driven by ``EngineLoop(is_pipelined=True)`` at random times.

The loop must (a) overlap steps (a forward starts before the previous step commits), (b) never
write imported KV while a forward is in flight (a spy around the real runner checks every write),
(c) produce exactly the co-located tokens, text and logprobs, (d) free the KV of aborted requests
at once and import new requests into those very blocks without corruption, (e) fail every held
request on a failed forward and serve on, and (f) stop with steps in flight and jobs queued
without hanging a request, a job or the device thread."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time

import pytest

from deepinfer.engine.core.factory import build_engine
from deepinfer.engine.core.options import EngineOptions
from deepinfer.engine.kv.handoff import (
    KvCapture,
    KvPayload,
    NoRoom,
    PrefilledRequest,
    add_resumed,
    admit_prefilled,
    ends_at_prefill,
    export_kv,
    has_room,
    prefill_params,
)
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.engine.text.output_processor import merge_output
from deepinfer.runtime.disagg.engine_loop import EngineLoop
from tests.conftest import load_test_helper

helpers = load_test_helper("runtime/pd_core_helpers")
assert_same_outputs, mixed_requests, run_to_end = helpers.assert_same_outputs, helpers.mixed_requests, helpers.run_to_end

ENGINE = dict(dtype="float32", device="cpu", block_size=128, max_model_len=1024, num_threads=1)


@pytest.fixture(autouse=True)
def _restore_switch_interval():
    """A pipelined loop sets the process's GIL switch interval (as a decode process does)."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-pd-pipeline")
    write_tiny_model(path, seed=5, layers="WCHC")
    return path


def _core(model_dir, *, num_blocks=64, max_num_seqs=8):
    return build_engine(model_dir, EngineOptions(**ENGINE, num_blocks=num_blocks, max_num_seqs=max_num_seqs)).core


class ForwardSpy:
    """The real runner, watched: counts forwards in progress, flags any KV write that overlaps
    one, counts steps scheduled while a forward ran (the overlap), can fail one chosen forward."""

    def __init__(self, core):
        self._runner = core.runner
        self._schedule_step = core.schedule_step
        self.num_forwards = 0
        self.num_active = 0
        self.num_overlapped = 0  # non-empty steps scheduled while a forward was running
        self.num_writes = 0
        self.num_racy_writes = 0
        self.fail_forward: int | None = None
        self._lock = threading.Lock()
        core.runner = self
        core.schedule_step = self.schedule_step

    def schedule_step(self):
        is_overlapped = self.num_active > 0
        plan = self._schedule_step()
        if not plan.is_empty and (is_overlapped or self.num_active > 0):
            self.num_overlapped += 1
        return plan

    def execute(self, batch):
        with self._lock:
            self.num_forwards += 1
            self.num_active += 1
            index = self.num_forwards
        try:
            if index == self.fail_forward:
                raise RuntimeError("injected forward failure")
            return self._runner.execute(batch)
        finally:
            with self._lock:
                self.num_active -= 1

    def write_blocks(self, block_ids, tensors):
        self._write(self._runner.write_blocks, block_ids, tensors)

    def write_slot(self, slot, tensors):
        self._write(self._runner.write_slot, slot, tensors)

    def _write(self, write, *args):
        racy = self.num_active > 0
        write(*args)
        time.sleep(0.002)  # widen the window a concurrent forward would have to start in
        with self._lock:
            self.num_writes += 1
            self.num_racy_writes += racy or self.num_active > 0

    def __getattr__(self, name):
        return getattr(self._runner, name)


def _colocated(model_dir, reqs) -> dict:
    core = _core(model_dir)
    for rid, prompt, params, seed in reqs:
        add_resumed(core, rid, prompt, params, seed, [])
    return run_to_end(core)


def _prefilled(model_dir, reqs) -> dict[str, PrefilledRequest]:
    """Every request prefilled (one batch on a prefill core), exported as a decode would get it."""
    core, capture = _core(model_dir), KvCapture()
    for rid, prompt, params, seed in reqs:
        add_resumed(core, rid, prompt, prefill_params(params, 0), seed, [])
        capture.watch(rid)
    rid2req = {rid: (prompt, params, seed) for rid, prompt, params, seed in reqs}
    acc, out2pre = {}, {}
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        plan = core.schedule_step()
        capture.on_scheduled(plan, core.config.scheduler.block_size)
        if plan.is_empty:
            continue
        for out in core.commit_step(plan, core.sample_step(plan, core.execute(plan))):
            rid = out.request_id
            acc[rid] = merge_output(acc.get(rid), out)
            if not out.finished:
                continue
            kv = capture.take(rid)
            payload = export_kv(core.runner, kv)  # before the next step can reuse the blocks
            prompt, params, seed = rid2req[rid]
            first = acc[rid]
            toks = first.outputs[0].token_ids
            assert not ends_at_prefill(first, params, len(toks), len(prompt) + len(toks), 1024), rid
            out2pre[rid] = PrefilledRequest(rid, prompt, toks, params, seed, kv.num_computed_tokens,
                                            KvPayload(payload.names, [t.clone() for t in payload.tensors]),
                                            kv.window_start, kv.write_from, first.outputs[0].logprobs,
                                            first.prompt_logprobs)
    assert set(out2pre) == set(rid2req)
    return out2pre


class Decode:
    """A decode core behind a pipelined EngineLoop, importing the way DecodeService does."""

    def __init__(self, core, name="decode-t"):
        self.core = core
        self.spy = ForwardSpy(core)
        self.loop = EngineLoop(core, name=name, is_pipelined=True, switch_interval_s=0.0005)
        self.results: dict[str, asyncio.Future] = {}
        self.acc: dict = {}

    async def arrive(self, pre: PrefilledRequest, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        rid = pre.request_id
        done = self.results.setdefault(rid, asyncio.get_running_loop().create_future())
        while True:
            try:
                if not has_room(self.core, pre.num_computed_tokens):  # as DecodeService: no job, no drain
                    raise NoRoom(rid)
                delta = await self.loop.between_steps(lambda: admit_prefilled(self.core, pre))
                break
            except NoRoom:
                await asyncio.sleep(0.005)

        def sink(out):
            if done.done():
                return
            if isinstance(out, BaseException):
                done.set_exception(out)
                return
            self.acc[rid] = merge_output(self.acc.get(rid), out)
            if out.finished:
                done.set_result(self.acc[rid])

        sink(delta)
        if rid in self.core.scheduler.requests:
            self.loop.add_sink(rid, sink)

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        end = time.monotonic() + timeout_s
        while self.core.has_unfinished_requests() or self.loop.has_work:
            assert time.monotonic() < end, "the decode loop did not go idle"
            await asyncio.sleep(0.01)

    def assert_all_kv_free(self) -> None:
        sched = self.core.scheduler
        self.core.check_integrity()
        assert not sched.requests
        assert sched.pool.num_free_blocks == self.core.config.num_blocks
        assert sched.slots.num_free_slots == sched.config.max_num_seqs


@pytest.mark.timeout(300)
async def test_pipelined_decode_equals_colocated_for_32_requests_at_random_times(model_dir):
    reqs = mixed_requests(32, seed=1)
    want = _colocated(model_dir, reqs)
    pres = _prefilled(model_dir, reqs)
    decode = Decode(_core(model_dir, max_num_seqs=8))  # 32 requests, 8 slots: imports wait for room
    rng = random.Random(3)
    decode.loop.start()
    try:
        arrivals = [asyncio.create_task(decode.arrive(pres[rid], rng.uniform(0.0, 1.5))) for rid, *_ in reqs]
        await asyncio.wait_for(asyncio.gather(*arrivals), 120)
        got = {rid: await asyncio.wait_for(decode.results[rid], 120) for rid, *_ in reqs}
        await decode.wait_idle()
    finally:
        await decode.loop.stop()
    assert_same_outputs(got, want, [r[0] for r in reqs])
    spy, loop = decode.spy, decode.loop
    assert spy.num_writes == 2 * len(reqs) and spy.num_racy_writes == 0  # blocks + slot per import
    assert loop.num_drains >= 1  # imports arrived while steps were in flight
    # steps overlapped (a serial loop never schedules during a forward; how often a pipelined one
    # manages to depends on how the OS shares 2 busy cores between the two threads)
    assert spy.num_overlapped > 0, (spy.num_overlapped, loop.num_steps)
    decode.assert_all_kv_free()


@pytest.mark.timeout(300)
async def test_aborts_mid_decode_free_kv_that_new_imports_reuse_intact(model_dir):
    """4 blocks, 4 slots: after aborting the 4 running requests mid-decode, the next 4 imports
    can only get the aborted requests' blocks and slots, which the steps still in flight at
    the abort write into; they must decode exactly as co-located (the drain orders them).
    Prompt + outputs < 128: one block each for life (no preemption in a 4-block pool); the
    aborted requests are short, so a stale step's KV write lands at rows the imports read."""
    first = mixed_requests(4, seed=2, prompt_lens=((5, 12),), max_tokens=(60, 60))
    second = mixed_requests(4, seed=3, prompt_lens=((50, 60),), max_tokens=(10, 20))
    want = _colocated(model_dir, second)
    pres = _prefilled(model_dir, first + second)
    decode = Decode(_core(model_dir, num_blocks=4, max_num_seqs=4))
    core = decode.core
    decode.loop.start()
    try:
        await asyncio.gather(*(decode.arrive(pres[rid]) for rid, *_ in first))
        for _ in range(2000):  # every first request is decoding, with steps in flight
            if all(len(decode.acc[rid].outputs[0].token_ids) >= 4 for rid, *_ in first):
                break
            await asyncio.sleep(0.005)
        assert decode.loop.has_work
        for rid, *_ in first:
            assert decode.loop.abort(rid)
        assert not core.scheduler.requests  # freed at once, in-flight steps or not
        assert core.scheduler.pool.num_free_blocks == 4 and core.scheduler.slots.num_free_slots == 4
        await asyncio.gather(*(decode.arrive(pres[rid]) for rid, *_ in second))
        got = {rid: await asyncio.wait_for(decode.results[rid], 60) for rid, *_ in second}
        await decode.wait_idle()
    finally:
        await decode.loop.stop()
    assert_same_outputs(got, want, [r[0] for r in second])
    for rid, *_ in first:  # aborted: the sink was dropped, never finished
        assert not decode.results[rid].done() and len(decode.acc[rid].outputs[0].token_ids) < 60
    assert decode.spy.num_racy_writes == 0
    decode.assert_all_kv_free()


@pytest.mark.timeout(300)
async def test_failed_forward_fails_every_held_request_and_the_loop_serves_on(model_dir):
    reqs = mixed_requests(6, seed=4, max_tokens=(30, 30))
    later = mixed_requests(3, seed=5, max_tokens=(8, 12))
    want = _colocated(model_dir, later)
    pres = _prefilled(model_dir, reqs + later)
    decode = Decode(_core(model_dir))
    decode.loop.start()
    try:
        await asyncio.gather(*(decode.arrive(pres[rid]) for rid, *_ in reqs))
        decode.spy.fail_forward = decode.spy.num_forwards + 3
        for rid, *_ in reqs:
            with pytest.raises(RuntimeError, match="step failed: injected forward failure"):
                await asyncio.wait_for(decode.results[rid], 60)
        await decode.wait_idle()
        decode.assert_all_kv_free()
        await asyncio.gather(*(decode.arrive(pres[rid]) for rid, *_ in later))
        got = {rid: await asyncio.wait_for(decode.results[rid], 60) for rid, *_ in later}
        await decode.wait_idle()
    finally:
        await decode.loop.stop()
    assert_same_outputs(got, want, [r[0] for r in later])
    decode.assert_all_kv_free()


@pytest.mark.timeout(120)
async def test_stop_with_steps_in_flight_and_jobs_queued_strands_nothing(model_dir):
    reqs = mixed_requests(4, seed=6, max_tokens=(200, 200))
    queued = mixed_requests(1, seed=7)
    pres = _prefilled(model_dir, reqs + queued)
    decode = Decode(_core(model_dir), name="decode-stop")
    decode.loop.start()
    await asyncio.gather(*(decode.arrive(pres[rid]) for rid, *_ in reqs))
    while sum(len(decode.acc[rid].outputs[0].token_ids) for rid, *_ in reqs) < 12:
        await asyncio.sleep(0.005)
    job = asyncio.create_task(decode.arrive(pres[queued[0][0]]))
    await asyncio.sleep(0)  # the job is queued behind the step in flight
    assert decode.loop.has_work
    await asyncio.wait_for(decode.loop.stop(), 30)
    for rid, *_ in reqs:
        with pytest.raises(RuntimeError, match="decode-stop stopped"):
            await asyncio.wait_for(decode.results[rid], 1)
    # the job failed with the stop, or (had the drain finished first) ran and its request's sink did
    (outcome,) = await asyncio.wait_for(asyncio.gather(job, return_exceptions=True), 1)
    with pytest.raises(RuntimeError, match="decode-stop stopped"):
        if isinstance(outcome, BaseException):
            raise outcome
        await asyncio.wait_for(decode.results[queued[0][0]], 1)
    assert not [t for t in threading.enumerate() if t.name.startswith("decode-stop-device")]
    with pytest.raises(RuntimeError, match="stopped"):
        await decode.loop.between_steps(lambda: None)


def test_a_pipelined_loop_refuses_a_schedule_hook(model_dir):
    with pytest.raises(ValueError, match="on_scheduled needs the serial loop"):
        EngineLoop(_core(model_dir, num_blocks=4, max_num_seqs=1), on_scheduled=lambda plan: None, is_pipelined=True)
