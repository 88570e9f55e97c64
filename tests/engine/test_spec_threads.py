"""The drafter's pass runs with the intra-op thread count the SPS calibration found fastest.

- ``intra_op_threads`` sets the count for its body and restores it, also after an error;
- ``threads_for`` maps a batch of N proposals to the count measured at the smallest grid point
  >= N; ``fastest_drafter`` keeps per request count the thread count of the smaller median;
- the table carries the counts through JSON and refuses counts off its grid;
- an engine with 2 torch threads calibrates a count per grid point (1 or 2), its proposer holds
  them, greedy outputs equal speculation off, and a thread started afterwards still gets 2 (with
  OpenMP the count is per thread; a new thread takes the process-wide one the switch restored).
"""

from __future__ import annotations

import threading

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.models.deepseek_v41.builtin_checkpoint import BUILTIN_DIR, builtin_checkpoint
from deepinfer.engine.spec.proposer import intra_op_threads, threads_for
from deepinfer.engine.spec.sps_calibration import fastest_drafter
from deepinfer.engine.spec.sps_table import SpsTable


def _count_in_a_new_thread() -> int:
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


@pytest.mark.timeout(30)
def test_intra_op_threads_sets_and_restores(restore_threads):
    torch.set_num_threads(2)
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    for unchanged in (None, 0, 2):
        with intra_op_threads(unchanged):
            assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), intra_op_threads(1):
        raise RuntimeError("a failed pass")
    assert torch.get_num_threads() == 2


@pytest.mark.timeout(30)
def test_threads_for_takes_the_next_grid_point():
    grid = {1: 1, 4: 1, 16: 2, 64: 2}
    assert [threads_for(grid, n) for n in (1, 2, 4, 5, 16, 17, 64, 500)] == [1, 1, 1, 2, 2, 2, 2, 2]
    assert threads_for({}, 3) is None and threads_for(None, 3) is None


@pytest.mark.timeout(30)
def test_fastest_drafter_keeps_the_smaller_median():
    timings = {(1, 2): [9e-3, 1e-2, 2e-2], (1, 1): [5e-3, 6e-3, 7e-3],
               (4, 2): [4e-3, 5e-3, 6e-3], (4, 1): [8e-3, 8e-3, 9e-3],
               (16, 2): [1e-2], (16, 1): [1e-2]}
    seconds, threads = fastest_drafter(timings)
    assert threads == {1: 1, 4: 2, 16: 2}  # a tie keeps the larger count
    assert seconds == pytest.approx({1: 6e-3, 4: 5e-3, 16: 1e-2})


@pytest.mark.timeout(30)
def test_table_keeps_thread_counts_through_json():
    steps = {r: {r: 1e-3 * r, 2 * r: 2e-3 * r} for r in (1, 4)}
    table = SpsTable(steps, {1: 1e-3, 4: 2e-3}, max_depth=1, draft_threads={1: 1, 4: 2})
    back = SpsTable.from_json(table.to_json())
    assert back.draft_threads == {1: 1, 4: 2}
    assert SpsTable.from_json(SpsTable(steps, {1: 1e-3, 4: 2e-3}, max_depth=1).to_json()).draft_threads is None
    with pytest.raises(ValueError, match="thread counts"):
        SpsTable(steps, {1: 1e-3, 4: 2e-3}, max_depth=1, draft_threads={1: 1})
    with pytest.raises(ValueError, match="thread counts"):
        SpsTable(steps, {1: 1e-3, 4: 2e-3}, max_depth=1, draft_threads={1: 0, 4: 1})


@pytest.mark.timeout(240)
@pytest.mark.skipif(builtin_checkpoint() is None, reason="the trained tiny checkpoint is not in this tree")
def test_engine_with_two_threads_calibrates_a_count_per_grid_point(restore_threads):
    prompts = ["def get(root):\n", "def unique_everseen(iterable, key=None):\n", "import os\n\n\ndef "]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = dict(max_num_seqs=4, block_size=16, max_model_len=256, seed=0, num_threads=2)
    outputs = {}
    for name, spec in (("off", {}), ("sched", dict(speculative="dspark", spec_schedule="confidence"))):
        llm = LLM(str(BUILTIN_DIR), **engine, **spec)
        try:
            outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            if spec:
                core = llm.engine.core
                table = core.spec.sps
                assert set(table.draft_threads) == set(table.grid) == {1, 4}
                assert set(table.draft_threads.values()) <= {1, 2}
                assert core.spec.proposer.draft_threads == table.draft_threads
                assert core.spec.stats.num_accepted > 0  # the drafter ran and was right at times
            assert _count_in_a_new_thread() == 2
        finally:
            llm.shutdown()
    assert outputs["sched"] == outputs["off"]
