"""``deepinfer node --role decode --ep 2``: a P/D decode engine whose MoE layers run expert-parallel
over two rank processes (runtime/ep/node_group.py), behind a real prefill node and the P/D client
(``deepinfer node`` processes under the supervisor, tiny float32 DeepSeek-V4 on CPU).

Greedy tokens equal a co-located single-process engine's exactly. Killing the decode node's
second rank fails its requests with the group's error within 10 s, the node ends itself (exit 3),
the supervisor starts a new one and the cluster serves again with the same tokens."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.core.factory import build_engine
from deepinfer.engine.core.options import EngineOptions
from deepinfer.engine.kv.handoff import add_resumed
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model
from deepinfer.engine.text.output_processor import merge_output
from deepinfer.runtime.disagg.launch import LocalPdCluster
from deepinfer.transport.protocol import FailurePolicy
from tests.conftest import load_test_helper

run_to_end = load_test_helper("runtime/pd_core_helpers").run_to_end

ENGINE = dict(dtype="float32", block_size=128, max_model_len=512, num_blocks=16, max_num_seqs=4, num_threads=1)
pytestmark = pytest.mark.timeout(180)


class EpDecodeCluster(LocalPdCluster):
    """One prefill node and one decode node run with ``--ep 2``."""

    def _argv(self, cluster_path, name):
        argv = super()._argv(cluster_path, name)
        return argv + ["--ep", "2", "--ep-redundant-experts", "1"] if name.startswith("decode") else argv


def _requests():
    prompts = [[5 + (7 * i + 3 * j) % 3000 for j in range(10 + 9 * i)] for i in range(4)]
    return [(f"ep-{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for i, p in enumerate(prompts)]


def _colocated(model_dir, reqs):
    core = build_engine(model_dir, EngineOptions(**{k: v for k, v in ENGINE.items() if k != "num_threads"})).core
    for rid, prompt, params in reqs:
        add_resumed(core, rid, prompt, params, 0, [])
    acc = run_to_end(core)
    return {rid: acc[rid].outputs[0].token_ids for rid, *_ in reqs}


async def _generate(client, rid, prompt, params, started=None):
    acc = None
    async for out in client.generate({"prompt_token_ids": prompt}, params, request_id=rid):
        acc = merge_output(acc, out)
        if started is not None and len(acc.outputs[0].token_ids) >= 2:
            started.set()
    assert acc is not None and acc.finished
    return acc.outputs[0].token_ids


def _rank_children(pid: int) -> list[int]:
    """Processes started by ``pid`` that run an EP rank worker."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"deepinfer.runtime.ep.rank_worker" in cmd:
            found.append(int(entry.name))
    return found


def test_decode_node_with_ep2_serves_colocated_tokens_and_restarts_after_a_rank_dies(tmp_path):
    model_dir = tmp_path / "tiny"
    write_tiny_model(model_dir, seed=5, layers="WCH")
    reqs = _requests()
    want = _colocated(model_dir, reqs)
    pd = EpDecodeCluster(model_dir, num_prefill=1, num_decode=1, engine_options=ENGINE, lease_s=30.0,
                         request_timeout_s=60.0, heartbeat_interval_s=0.2, failure_policy=FailurePolicy.FAIL,
                         log_dir=tmp_path / "logs")
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(pd.start(ready_timeout_s=120))
        node_pid = pd.supervisor.pid("decode-0")
        ranks = _rank_children(node_pid)
        assert len(ranks) == 1, ranks  # rank 0 is the node itself

        async def run_all():
            return await asyncio.gather(*(asyncio.wait_for(_generate(pd.client, *r), 60) for r in reqs))

        got = loop.run_until_complete(run_all())
        assert dict(zip([r[0] for r in reqs], got)) == want

        async def kill_mid_stream():
            started = asyncio.Event()
            long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            tasks = [asyncio.ensure_future(asyncio.wait_for(_generate(pd.client, f"long-{i}", p, long, started), 60))
                     for i, (_, p, _) in enumerate(reqs[:2])]
            await asyncio.wait_for(started.wait(), 60)
            t_kill = time.monotonic()
            os.kill(ranks[0], signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, time.monotonic() - t_kill

        results, elapsed = loop.run_until_complete(kill_mid_stream())
        assert elapsed < 10.0, elapsed
        for result in results:
            assert isinstance(result, BaseException), result
            assert "EP rank" in str(result), repr(result)

        async def serves_again():
            deadline = time.monotonic() + 90
            while pd.supervisor.num_starts("decode-0") < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            log = (tmp_path / "logs" / "decode-0.log").read_text()
            assert "the EP group broke" in log, log[-3000:]
            await pd.wait_engines_up(90)
            return await run_all()

        got = loop.run_until_complete(serves_again())
        assert pd.supervisor.num_starts("decode-0") == 2
        assert dict(zip([r[0] for r in reqs], got)) == want
        assert len(_rank_children(pd.supervisor.pid("decode-0"))) == 1
    finally:
        loop.run_until_complete(pd.close())
        loop.close()


@pytest.mark.parametrize("argv, message", [
    (["--role", "decode", "--ep", "0"], "--ep must be >= 1"),
    (["--role", "decode", "--ep", "2", "--ep-redundant-experts", "-1"], "--ep-redundant-experts >= 0"),
    (["--role", "gateway", "--ep", "2"], "--ep N goes with --role prefill or --role decode"),
    (["--host", "h1", "--ep", "2"], "--ep N goes with --role prefill or --role decode"),
    (["--role", "prefill", "--speculative", "dspark"], "--speculative goes with --role decode"),
    (["--role", "decode", "--ep", "2", "--speculative", "dspark"], "does not run with --ep > 1 yet"),
    (["--role", "decode", "--num-draft-tokens", "0"], "--num-draft-tokens must be >= 1"),
])
def test_node_ep_flags_are_checked_before_anything_starts(tmp_path, capsys, argv, message):
    from deepinfer.bin.cli import main

    assert main(["node", "--cluster", str(tmp_path / "missing.toml"), *argv]) == 2
    assert message in capsys.readouterr().err
