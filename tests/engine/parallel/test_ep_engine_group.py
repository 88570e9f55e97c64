"""The EP engine group behind one EngineClient (what `deepinfer serve --ep N` serves): two real
rank processes over gloo give the tokens and logprobs of a plain engine; killing a rank mid-run
ends every request in flight with EpRankLostError within 10 s, and the group restarts and serves
the same outputs again."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

from deepinfer import AsyncEngine, SamplingParams
from deepinfer.runtime.ep.engine_group import EpEngineGroup, EpRankLostError

PROMPTS = [[5 + i, 17, 300 + i, 44, 99] * (i + 1) for i in range(6)]
OPTIONS = dict(max_num_seqs=4, num_threads=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model

    out = tmp_path_factory.mktemp("ep_group") / "tiny"
    write_tiny_model(out, seed=0, layers="WCH", num_hash_layers=1)
    return out


async def run(client, rid, ids, max_tokens):
    tokens, logprobs = [], []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1)
    async for out in client.generate({"prompt_token_ids": ids}, params, request_id=rid):
        tokens += out.outputs[0].token_ids
        logprobs += [position[t].logprob for position, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    return tokens, logprobs


def assert_same(got, want):
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) <= 1e-5


async def assert_ep_figures(group):
    """The ranks' reports reach the front's stats() and its /metrics (the restarted group's)."""
    from deepinfer.runtime.ep.rank_worker import STATS_INTERVAL_S
    from deepinfer.runtime.gateway.metrics import GatewayMetrics

    deadline = time.monotonic() + 5 * STATS_INTERVAL_S
    while not all(r.stats is not None and r.stats.ep.get("num_steps", 0) > 0 for r in group._ranks):
        assert time.monotonic() < deadline, "no stepping EP figures from every rank"
        await asyncio.sleep(0.1)
    st = group.stats()
    assert st.ep["ranks"] == st.ep["size"] == 2 and st.ep["restarts"] == 1 and st.ep["broken"] == 0
    assert st.ep["num_steps"] >= 12 and st.ep["replacement_off"] == 0 and 0.0 <= st.kv_cache_usage <= 1.0
    text = GatewayMetrics(group).render().decode()
    assert "deepinfer_ep_restarts_total 1.0" in text and "deepinfer_ep_ranks 2.0" in text
    steps = re.search(r"^deepinfer_ep_steps_total (\S+)$", text, re.M)
    assert steps is not None and float(steps.group(1)) >= st.ep["num_steps"]  # the group keeps polling


@pytest.mark.timeout(240)
def test_ep_group_serves_fails_a_dead_rank_fast_and_restarts(tiny_dir):
    async def main():
        reference = await AsyncEngine.start(str(tiny_dir), **OPTIONS)
        try:
            want = await asyncio.gather(*(run(reference, f"ref{i}", p, 12) for i, p in enumerate(PROMPTS)))
        finally:
            await reference.shutdown()
        group = await EpEngineGroup.start(str(tiny_dir), ep_size=2, ep_settings=dict(redundant_per_rank=2, window=8,
                                                                                         period=40), **OPTIONS)
        try:
            assert group.model_info.vocab_size == 4096
            got = await asyncio.gather(*(run(group, f"a{i}", p, 12) for i, p in enumerate(PROMPTS)))
            assert_same(got, want)
            assert {len(r.outstanding) for r in group._ranks} == {0}

            # long requests on both ranks, then one rank dies
            long = [asyncio.create_task(run(group, f"b{i}", p, 400)) for i, p in enumerate(PROMPTS)]
            await asyncio.sleep(0.5)
            assert all(not t.done() for t in long), "the requests finished before the rank was killed"
            victim = group._ranks[1].proc.pid
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            errors = await asyncio.gather(*long, return_exceptions=True)
            waited = time.monotonic() - killed
            assert waited < 10.0, f"requests of the dead group ended {waited:.1f} s after the kill"
            for err in errors:
                assert isinstance(err, EpRankLostError), err
                assert f"EP rank 1 (pid {victim}) exited with status -9" in str(err)

            # the group restarts by itself and serves the same outputs again
            again = await asyncio.gather(*(run(group, f"c{i}", p, 12) for i, p in enumerate(PROMPTS)))
            assert_same(again, want)
            assert group.num_restarts == 1 and victim not in [r.proc.pid for r in group._ranks]
            await group.check_health()
            await assert_ep_figures(group)
            ranks = list(group._ranks)
        finally:
            await group.shutdown()
        # a graceful stop: every rank left the group in the same last round and exited 0
        assert [r.proc.returncode for r in ranks] == [0, 0]

    asyncio.run(main())


@pytest.mark.parametrize("argv, message", [
    (["--ep", "0"], "--ep must be >= 1"),
    (["--ep", "2", "--ep-redundant-experts", "-1"], "--ep-redundant-experts >= 0"),
    (["--ep", "2", "--speculative", "dspark"], "does not run with --ep > 1 yet"),
])
def test_serve_ep_flags_are_checked(argv, message, capsys):
    from deepinfer.bin.cli import main

    assert main(["serve", "--port", "0", *argv]) == 2
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
