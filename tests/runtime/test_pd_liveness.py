"""Liveness of a disaggregated cluster under stalls and kills: real engine processes (``deepinfer
node`` under the supervisor, 1 prefill + 2 decode, tiny float32 model on CPU), the gateway's
``PdEngineClient`` in this process, default failure-detection settings.

- Every engine SIGSTOPped at once for 1.2 s (twice the old 0.6 s death sentence), then the
  gateway's own loop blocked for 2.5 s (past the 2 s suspicion floor: the engines are probed and
  answer): nobody is declared down — not by the gateway, not by the engines among themselves —
  and every request completes on its first attempt with the tokens of an undisturbed run.
- A SIGKILLed decode is declared down by the gateway within one probe timeout (its supervisor
  saw the exit) and by its peers, which only see the silence, within max silence + probe
  timeout; its requests are recomputed on the other decode with the same tokens.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.runtime.disagg.launch import LocalPdCluster
from deepinfer.runtime.failure_detector import DetectorSettings
from deepinfer.transport.channels import EventSubscriber
from deepinfer.transport.protocol import TOPIC_PEER, PeerDown, PeerEvent

ENGINE = dict(dtype="float32", block_size=128, max_model_len=1024, num_blocks=64, max_num_seqs=16, num_threads=1)
DEFAULTS = DetectorSettings(interval_s=0.2)  # what serve --disaggregated uses unless told otherwise
OLD_DOWN_AFTER_S = 0.6  # the fixed rule this replaces: 3 missed beats of 0.2 s

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-pd-liveness")
    write_tiny_model(model_dir, seed=5, layers="WCHC")
    pd = LocalPdCluster(model_dir, num_prefill=1, num_decode=2, engine_options=ENGINE, lease_s=30.0,
                        request_timeout_s=120.0, heartbeat_interval_s=DEFAULTS.interval_s)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(pd.start(ready_timeout_s=180))
        yield pd, loop
    finally:
        loop.run_until_complete(pd.close())
        loop.close()


class DownRecorder:
    """Every PeerDown the gateway decides and every one an engine publishes about its peers."""

    def __init__(self, pd):
        self.seen: list[tuple[float, str, PeerDown]] = []  # (when, who decided, event)
        pd.client.directory.add_listener(self._on_gateway_event)
        self._subscriber = EventSubscriber(PeerEvent, topics=[TOPIC_PEER], name="test-peer-views")
        self._addresses = [pd.config.node(n).events for n in pd.engine_names()]
        self._task = None

    def _on_gateway_event(self, event):
        if isinstance(event, PeerDown):
            self.seen.append((time.monotonic(), "gateway", event))

    async def start(self):
        await self._subscriber.start()
        for address in self._addresses:
            self._subscriber.connect(address)
        self._task = asyncio.ensure_future(self._listen())
        await asyncio.sleep(0.3)  # SUB joins before anything happens

    async def _listen(self):
        async for _, msg in self._subscriber:
            if isinstance(msg, PeerDown):
                self.seen.append((time.monotonic(), "engine", msg))

    async def close(self):
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._subscriber.close()


def _requests(n, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [(f"r{i}", [(31 * i + 7 * k) % 3900 + 5 for k in range(12 + 5 * i)], params) for i in range(n)]


async def _stream(client, rid, prompt, params, times):
    tokens = []
    async for out in client.generate({"prompt_token_ids": prompt}, params, request_id=rid):
        tokens += out.outputs[0].token_ids
        times.append((time.monotonic(), len(tokens)))
    return tokens


async def _run(pd, reqs, tag):
    times = {rid: [] for rid, *_ in reqs}
    tasks = [asyncio.ensure_future(_stream(pd.client, f"{tag}-{rid}", p, sp, times[rid])) for rid, p, sp in reqs]
    return tasks, times


async def _until_streaming(times, num_tokens, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while not all(t and t[-1][1] >= num_tokens for t in times.values()):
        assert time.monotonic() < end, "requests did not start streaming"
        await asyncio.sleep(0.02)


def test_stalled_engines_and_a_stalled_gateway_kill_nothing(cluster):
    pd, loop = cluster
    reqs = _requests(6, max_tokens=120)

    async def go():
        reference = await asyncio.gather(*(await _run(pd, reqs, "ref"))[0])
        recorder = DownRecorder(pd)
        await recorder.start()
        lost_before = pd.client.num_attempts_lost
        tasks, times = await _run(pd, reqs, "stall")
        pids = [pd.supervisor.pid(n) for n in pd.engine_names()]
        try:
            await _until_streaming(times, 5)
            for pid in pids:  # the heartbeat senders: every engine, at the same instant
                os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(2 * OLD_DOWN_AFTER_S)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(0.5)
        time.sleep(2.5)  # the observer: the gateway's loop starved past the suspicion floor
        results = await asyncio.gather(*tasks)
        await asyncio.sleep(2 * DEFAULTS.interval_s)  # a verdict of the last moment still lands
        await recorder.close()
        return reference, results, recorder.seen, pd.client.num_attempts_lost - lost_before

    reference, results, downs, num_lost = loop.run_until_complete(go())
    assert downs == [], downs
    assert num_lost == 0
    assert results == reference
    assert all(len(tokens) == 120 for tokens in results)
    assert all(pd.client.directory.engines[n].is_up for n in pd.engine_names())


def test_sigkilled_decode_is_down_within_the_bound_and_its_requests_are_recomputed(cluster):
    pd, loop = cluster
    reqs = _requests(8, max_tokens=100)
    bound_s = DEFAULTS.max_detection_s + 1.0  # + sweep period and a loaded host's loop lag

    async def go():
        await pd.wait_engines_up(60)
        reference = await asyncio.gather(*(await _run(pd, reqs, "ref2"))[0])
        recorder = DownRecorder(pd)
        await recorder.start()
        lost_before = pd.client.num_attempts_lost
        tasks, times = await _run(pd, reqs, "kill")
        await _until_streaming(times, 20)
        await pd.supervisor.kill("decode-0", signal.SIGKILL)  # held: it stays down
        killed_at = time.monotonic()
        results = await asyncio.gather(*tasks)
        while len([1 for _, who, e in recorder.seen if who == "engine" and e.node_name == "decode-0"]) < 2 \
                and time.monotonic() < killed_at + bound_s + 1.0:  # the peers' verdicts may come later
            await asyncio.sleep(0.05)
        await recorder.close()
        return reference, results, times, killed_at, recorder.seen, pd.client.num_attempts_lost - lost_before

    reference, results, times, killed_at, downs, num_lost = loop.run_until_complete(go())
    # the gateway: its supervisor saw the process exit, so it probed at once (one probe timeout)
    gateway_downs = [(when, e) for when, who, e in downs if who == "gateway"]
    assert [e.node_name for _, e in gateway_downs] == ["decode-0"], downs
    gateway_after = gateway_downs[0][0] - killed_at
    assert gateway_after <= DEFAULTS.probe_timeout_s + 1.0, gateway_after
    # the prefill and the other decode know only the silence: suspected past the floor, probed,
    # down within max silence + probe timeout
    engine_after = [when - killed_at for when, who, e in downs if who == "engine" and e.node_name == "decode-0"]
    assert len(engine_after) == 2, downs
    assert all(DEFAULTS.min_silence_s - DEFAULTS.interval_s <= t <= bound_s for t in engine_after), engine_after
    assert num_lost >= 1  # decode-0 held some of the 8 streams
    assert results == reference
    # the recomputed streams resumed after the gateway's verdict plus one prefill + handoff
    stalled = [t for t in times.values() if any(a < killed_at < b for (a, _), (b, _) in zip(t, t[1:]))]
    resumed_after = [next(when for when, _ in t if when > killed_at) - killed_at for t in stalled]
    assert resumed_after and max(resumed_after) <= gateway_after + 5.0, resumed_after
    print(f"decode-0 down at the gateway {gateway_after:.2f}s, at its peers {engine_after} s after SIGKILL; "
          f"streams resumed within {max(resumed_after):.2f}s")
