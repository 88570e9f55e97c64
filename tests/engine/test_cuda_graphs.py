"""CUDA graphs of decode steps and the packed context (engine/core/cuda_graphs.py).

CPU: the packed layout and signature of real V4 contexts (built from ForwardBatches by the model's
own builder), a round trip through one byte buffer, and what refuses to pack. GPU (gpu marker):
the runner with graphs against the same runner eager, on the tiny V4 and the tiny V4.1, bf16 and
float32: decode steps of sequences at different positions (window filling, compressed entries
closing, candidate buckets growing) give bitwise the eager logits, graphs are replayed, and a model
with forward hooks never replays.
"""

from __future__ import annotations

import random

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.core.batch import ForwardBatch, SeqStep, TokenSource
from deepinfer.engine.core.cuda_graphs import layout, pack
from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.context import build_context
from deepinfer.engine.models.deepseek_v4.testing import CSA, HCA, SLIDING, hf_reference

pytestmark = pytest.mark.timeout(240)
LAYERS = dict(layer_types=[SLIDING, CSA, HCA, CSA], hc_mult=2)
BLOCK = 16


@pytest.fixture(scope="module")
def ref():
    return hf_reference(seed=3, **LAYERS)


def _runner(ref, device, dtype, graphs, num_seqs=4, max_len=400):
    per = -(-max_len // BLOCK)
    return ModelRunner(ref.config, ref.state_dict, num_blocks=num_seqs * per, num_slots=num_seqs, block_size=BLOCK,
                       device=device, dtype=dtype, cuda_graphs=graphs)  # fmt: skip


def _decode_batch(positions: list[int], per: int) -> ForwardBatch:
    return ForwardBatch([SeqStep(i, i, list(range(i * per, (i + 1) * per)), p, [5 + i], num_logits=1)
                         for i, p in enumerate(positions)])  # fmt: skip


def test_signature_keys_on_shapes_not_values(ref):
    runner = _runner(ref, "cpu", torch.float32, False)
    geo = runner.geometry
    per = 400 // BLOCK + 1

    def sig(positions, token=5):
        batch = _decode_batch(positions, per)
        for s in batch.steps:
            s.token_ids = [token]
        ctx = build_context(batch, geo, device=torch.device("cpu"), batch_invariant=False)
        return layout(ctx).signature

    # same shapes (full window, no entry closing at either position, same candidate bucket)
    assert sig([301]) == sig([302], token=9)
    assert sig([301]) != sig([301, 302])  # another batch size
    assert sig([301]) != sig([40])  # window still filling: fewer window rows
    assert sig([299]) != sig([301])  # 299 closes a ratio-4 entry (300 % 4 == 0), 301 does not


def test_pack_round_trip_keeps_every_tensor(ref):
    runner = _runner(ref, "cpu", torch.float32, False)
    per = 400 // BLOCK + 1
    rng = random.Random(0)
    for _ in range(5):
        positions = [rng.randrange(0, 380) for _ in range(rng.randrange(1, 4))]
        batch = ForwardBatch([SeqStep(i, i, list(range(i * per, (i + 1) * per)), p, [rng.randrange(100)
                              for _ in range(rng.randrange(1, 9))], num_logits=1) for i, p in enumerate(positions)])
        ctx = build_context(batch, runner.geometry, device=torch.device("cpu"), batch_invariant=False)
        lay = layout(ctx)
        before = [leaf.tensor.clone() for leaf in lay.leaves]
        buffer = torch.full((lay.nbytes,), 0xA5, dtype=torch.uint8)  # poisoned: padding never read
        pack(ctx, lay, torch.device("cpu"), into=buffer)
        after = layout(ctx)
        assert len(after.leaves) == len(before) and after.signature == lay.signature
        for old, leaf in zip(before, after.leaves):
            assert leaf.tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            assert torch.equal(old, leaf.tensor)


def test_layout_refuses_what_it_cannot_key_on():
    class Opaque:
        pass

    assert layout({"a": torch.zeros(3), "b": Opaque()}) is None
    assert layout({"a": (torch.zeros(2), 1)}) is None
    assert layout({"a": [torch.zeros(2, dtype=torch.bool), 3, None, "x"]}).signature is not None


@pytest.mark.parametrize("fed", ["run", "reversed"])
def test_device_fed_ids_equal_host_ids_cpu(ref, fed):
    per = 400 // BLOCK + 1
    rng = random.Random(4)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in (9, 40, 77)]
    host = _decode_run(_runner(ref, "cpu", torch.float32, False), prompts, 6, per)
    assert torch.equal(host, _decode_run(_runner(ref, "cpu", torch.float32, False), prompts, 6, per, fed=fed))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), size=st.integers(1, 40))
def test_token_source_write_matches_indexing(data, size):
    n = data.draw(st.integers(0, size))
    dst = data.draw(st.lists(st.integers(0, size - 1), min_size=n, max_size=n, unique=True))
    index = data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    if data.draw(st.booleans()) and n:  # a contiguous run on both sides (the copy path)
        a, b = data.draw(st.integers(0, size - n)), data.draw(st.integers(0, 51 - n))
        dst, index = list(range(a, a + n)), list(range(b, b + n))
    tokens = torch.randint(0, 1000, (51,))
    got = torch.full((size,), -7, dtype=torch.long)
    TokenSource(tokens, dst, index).write(got)
    want = torch.full((size,), -7, dtype=torch.long)
    for d, i in zip(dst, index):
        want[d] = tokens[i]
    assert torch.equal(got, want)


def test_token_source_refusals(ref):
    runner = _runner(ref, "cpu", torch.float32, False)
    per = 400 // BLOCK + 1
    ids = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="destinations"):
        TokenSource(ids, [0, 1], [0])
    two = ForwardBatch([SeqStep(0, 0, list(range(per)), 0, [1, 2], num_logits=1)],
                       token_source=TokenSource(ids, [0], [0]))  # fmt: skip
    with pytest.raises(ValueError, match="single-token steps"):
        runner.execute(two)
    outside = ForwardBatch([SeqStep(0, 0, list(range(per)), 0, [1], num_logits=1)],
                           token_source=TokenSource(ids, [1], [0]))  # fmt: skip
    with pytest.raises(ValueError, match="outside the batch"):
        runner.execute(outside)
    flat = ForwardBatch([SeqStep(0, 0, list(range(per)), 0, [1], num_logits=1)],
                        token_source=TokenSource(ids.view(2, 1), [0], [0]))  # fmt: skip
    with pytest.raises(ValueError, match="1-D tensor"):
        runner.execute(flat)


def needs_cuda(test):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(skip(test))


def _decode_run(runner, prompts, steps, per, fed: str | None = None):
    """Prefill each prompt, then ``steps`` batched greedy decode steps; every step's logits.
    ``fed``: the decode steps take their ids from the device argmax through a TokenSource, in
    order ("run") or from a reversed tensor ("reversed", the index path); the steps hold 0."""
    batch = ForwardBatch([SeqStep(i, i, list(range(i * per, (i + 1) * per)), 0, p, num_logits=1)
                          for i, p in enumerate(prompts)])  # fmt: skip
    logits = runner.execute(batch)
    out = [logits.float().cpu()]
    positions = [len(p) for p in prompts]
    n = len(prompts)
    for _ in range(steps):
        source = None
        if fed is None:
            tokens = logits.argmax(-1).tolist()
        else:
            tokens = [0] * n
            ids = logits.argmax(-1)
            if fed == "run":
                source = TokenSource(ids, list(range(n)), list(range(n)))
            else:
                source = TokenSource(ids.flip(0), list(range(n)), [n - 1 - i for i in range(n)])
        batch = ForwardBatch([SeqStep(i, i, list(range(i * per, (i + 1) * per)), positions[i], [tokens[i]],
                                      num_logits=1) for i in range(n)], token_source=source)  # fmt: skip
        logits = runner.execute(batch)
        out.append(logits.float().cpu())
        positions = [p + 1 for p in positions]
    return torch.stack(out)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_decode_equals_eager_v4(ref, dtype):
    per = 400 // BLOCK + 1
    rng = random.Random(1)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in (7, 130, 251)]
    eager = _decode_run(_runner(ref, "cuda", dtype, False), prompts, 60, per)
    runner = _runner(ref, "cuda", dtype, True)
    graphed = _decode_run(runner, prompts, 60, per)
    stats = runner.graphs.stats
    assert stats.failed == 0, stats
    assert stats.replays >= 30, stats
    assert torch.equal(eager, graphed)
    for fed in ("run", "reversed"):  # ids fed on the device: captures, replays and eager first sightings
        assert torch.equal(eager, _decode_run(_runner(ref, "cuda", dtype, True), prompts, 60, per, fed=fed))


@needs_cuda
def test_hooks_turn_graphs_off(ref):
    per = 400 // BLOCK + 1
    runner = _runner(ref, "cuda", torch.bfloat16, True)
    seen = []
    handle = runner.model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(1))
    try:
        _decode_run(runner, [[1, 2, 3]], 8, per)
    finally:
        handle.remove()
    assert runner.graphs.stats.replays == 0 and runner.graphs.stats.captures == 0


def _tiny_v41(tmp_path, seed: int):
    """(the V4.1 test harness, a tiny V4.1 checkpoint written under ``tmp_path``)."""
    from tests.conftest import load_test_helper

    harness = load_test_helper("engine/v41/v41_harness")
    harness.write_tiny_v41(tmp_path / "m", seed=seed, **harness.TEST_SIZES)
    return harness, tmp_path / "m"


@needs_cuda
def test_graphed_decode_equals_eager_v41(tmp_path):
    harness, model_dir = _tiny_v41(tmp_path, seed=0)
    per = 24
    rng = random.Random(2)
    prompts = [[rng.randrange(50, 200) for _ in range(n)] for n in (5, 70, 150)]
    runs = []
    for graphs, fed in ((False, None), (True, None), (True, "reversed")):
        runner = harness.load_runner(model_dir, num_blocks=3 * per, num_slots=3, block_size=BLOCK, device="cuda",
                             dtype=torch.bfloat16, cuda_graphs=graphs)  # fmt: skip
        runs.append(_decode_run(runner, prompts, 40, per, fed=fed))
        if graphs:
            assert runner.graphs.stats.failed == 0 and runner.graphs.stats.replays >= 20, runner.graphs.stats
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


@needs_cuda
def test_a_v41_model_alone_routes_cuda_ops_to_the_kernels(tmp_path):
    """A process that loads only V4.1 (the built-in model) runs the Triton kernels, not the torch
    reference ops, on CUDA: the runner switches the routing on for any model it loads there."""
    from deepinfer.kernels import ops

    harness, model_dir = _tiny_v41(tmp_path, seed=0)
    ops.reset()
    try:
        harness.load_runner(model_dir, device="cuda", dtype=torch.bfloat16)
        assert ops.backend_of("moe_experts_") != "torch_ref" and ops.backend_of("rms_norm") != "torch_ref"
    finally:
        ops.use_gpu()  # the routing the other CUDA tests of this process expect


@needs_cuda
def test_graphed_forwards_hand_back_the_dspark_features(tmp_path):
    """DSpark's target features come from inside the forward: with the capture on, decode steps
    are still graphed, and each replay hands back that step's features, bitwise the eager ones."""
    from deepinfer.engine.models.deepseek_v41.dspark_serving import FeatureCapture

    harness, model_dir = _tiny_v41(tmp_path, seed=1)
    per = 24
    rng = random.Random(3)
    prompts = [[rng.randrange(50, 200) for _ in range(n)] for n in (9, 40, 75)]
    runs = []
    for graphs in (False, True):
        runner = harness.load_runner(model_dir, num_blocks=3 * per, num_slots=3, block_size=BLOCK, device="cuda",
                                     dtype=torch.bfloat16, cuda_graphs=graphs)  # fmt: skip
        capture = FeatureCapture(runner.model)
        feats = []
        execute = runner.execute

        def execute_and_take(batch, execute=execute, capture=capture, feats=feats):
            logits = execute(batch)
            rows, f = capture.take()
            feats.append(f.float().cpu())
            return logits

        runner.execute = execute_and_take
        logits = _decode_run(runner, prompts, 30, per)
        runs.append((logits, feats))
        if graphs:
            assert runner.graphs.stats.failed == 0 and runner.graphs.stats.replays >= 20, runner.graphs.stats
    (eager_logits, eager_feats), (graph_logits, graph_feats) = runs
    assert torch.equal(eager_logits, graph_logits)
    assert len(eager_feats) == len(graph_feats) == 31
    assert all(torch.equal(a, b) for a, b in zip(eager_feats, graph_feats))
    assert not torch.equal(graph_feats[-1], graph_feats[-2])  # each replay's own step, not a stale copy


@needs_cuda
def test_failed_capture_runs_eagerly_and_leaves_the_generator_usable(ref):
    from deepinfer.engine.core.cuda_graphs import GraphedForward

    def forward(ctx):  # .item() waits on the host: it cannot be captured
        x = ctx.token_ids.float() * 2
        return x + x.sum().item()

    geo = _runner(ref, "cpu", torch.float32, False).geometry
    graphs = GraphedForward(forward, torch.device("cuda"))
    for _ in range(3):  # first sighting eager, the second tries a capture (fails), the third runs eagerly
        ctx = build_context(_decode_batch([3, 9], 400 // BLOCK + 1), geo, device=torch.device("cpu"),
                            batch_invariant=False)  # fmt: skip
        out, graphed = graphs.run(ctx, 2)
        assert not graphed
    assert graphs.stats.failed == 1 and graphs.stats.captures == 0, graphs.stats
    ids = ctx.token_ids.float() * 2
    assert torch.equal(out.cpu(), (ids + ids.sum()).cpu())
    torch.nn.Embedding(8, 4, device="cuda")  # random init on the default generator: raised before the fix
    assert torch.isfinite(torch.randn(16, device="cuda")).all()


@needs_cuda
@pytest.mark.parametrize("name", ["hc1_hca8_window8", "hc3_csa2_wide"])
@pytest.mark.parametrize("lengths,chunk", [((400,), 33), ((300, 263, 226, 189), 41)])
def test_parity_configs_capture_chunked_prefill_and_decode(name, lengths, chunk):
    """Prefill chunks small enough to be graphed, then decode steps: one long sequence, and four of
    different lengths; every capture succeeds, and the logits are bitwise the eager ones."""
    from deepinfer.engine.models.deepseek_v4.testing import PARITY_CONFIGS, SeqDriver

    ref = hf_reference(seed=len(name), **PARITY_CONFIGS[name])
    per = 440 // BLOCK + 1
    rng = random.Random(4)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in lengths]
    runs = []
    for graphs in (False, True):
        runner = _runner(ref, "cuda", torch.float32, graphs, max_len=440)
        driver = SeqDriver(runner, per)
        for i, p in enumerate(prompts):
            driver.add(i, p)
        seqs = list(range(len(prompts)))
        runs.append(driver.greedy(seqs, 24, driver.prefill(seqs, chunk=chunk, all_logits=False)))
    stats = runner.graphs.stats
    assert stats.failed == 0 and stats.captures >= 1 and stats.replays >= 8, stats
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][i], runs[1][1][i]) for i in seqs)


def test_graph_size_limit_reaches_the_snapshot():
    from deepinfer import envs

    assert envs.load({}).cuda_graph_max_tokens == 512
    assert envs.load({"DEEPINFER_CUDA_GRAPH_MAX_TOKENS": "2048"}).cuda_graph_max_tokens == 2048
    with pytest.raises(ValueError, match="DEEPINFER_CUDA_GRAPH_MAX_TOKENS='lots' is not an integer"):
        envs.load({"DEEPINFER_CUDA_GRAPH_MAX_TOKENS": "lots"})


@needs_cuda
def test_the_runner_graphs_forwards_up_to_the_configured_size(ref, monkeypatch):
    from deepinfer import envs

    monkeypatch.setattr(envs, "_snapshot", envs.load({"DEEPINFER_CUDA_GRAPH_MAX_TOKENS": "1024"}))
    assert _runner(ref, "cuda", torch.float32, True).graphs.max_tokens == 1024
    monkeypatch.setattr(envs, "_snapshot", envs.load({"DEEPINFER_CUDA_GRAPH_MAX_TOKENS": "0"}))
    with pytest.raises(ValueError, match="DEEPINFER_CUDA_GRAPH_MAX_TOKENS must be >= 1"):
        _runner(ref, "cuda", torch.float32, True)
