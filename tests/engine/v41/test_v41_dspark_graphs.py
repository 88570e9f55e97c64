"""The drafter's proposal pass from CUDA graphs (engine/spec/graphed_proposals.py).

CPU: the bucket arithmetic and that a CPU proposer never graphs. CUDA (``-m gpu``): a proposer
with graphs gives, call for call, bitwise the eager pass over the same padded batch (the graph
reads the ring as it is at each call), and captures once per bucket.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine.models.deepseek_v41.dspark_serving import ServingDrafter
from deepinfer.engine.spec.graphed_proposals import bucket, padded
from deepinfer.engine.spec.proposer import DraftProposer
from tests.conftest import load_test_helper

harness = load_test_helper("engine/v41/v41_harness")
pytestmark = pytest.mark.timeout(240)


def test_buckets_are_powers_of_two_capped_by_the_slots():
    assert [bucket(n, 8) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert bucket(5, 6) == 6 and bucket(7, 6) == 7  # past the cap: the count itself
    assert padded([4, 7], 4) == [4, 7, 4, 4] and padded([3], 1) == [3]
    with pytest.raises(ValueError, match="needs >= 1 request"):
        bucket(0, 8)


def test_a_cpu_proposer_never_graphs(tiny_dir):
    runner = harness.load_runner(tiny_dir, num_blocks=16, num_slots=2, block_size=16)
    proposer = DraftProposer(ServingDrafter(runner.model, model_dir=tiny_dir), num_slots=2, cuda_graphs=True)
    assert proposer.graphs is None


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_a_model_built_for_a_device_holds_every_tensor_there(family):
    """Built on the meta device (no memory), every parameter and buffer must be there too: a
    tensor left on the host is copied in at each use, which a CUDA graph's capture refuses (the
    rope frequencies were, and no drafter pass could be captured on a GPU)."""
    if family == "v4":
        from deepinfer.engine.models.deepseek_v4.model import DeepseekV4ForCausalLM as Model
        from deepinfer.engine.models.deepseek_v4.tiny_model import tiny_config

        config = tiny_config()
    else:
        from deepinfer.engine.models.deepseek_v41.model import DeepseekV41ForCausalLM as Model
        from deepinfer.engine.models.deepseek_v41.tiny_model import tiny_v41_config

        config = tiny_v41_config(4096)
    model = Model(config, device="meta", dtype=torch.bfloat16)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    assert tensors and [name for name, t in tensors if t.device.type != "meta"] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_proposals_equal_the_eager_pass(tiny_dir):
    slots = 8
    runner = harness.load_runner(tiny_dir, num_blocks=64, num_slots=slots, block_size=16, device="cuda",
                                 dtype=torch.bfloat16)  # fmt: skip
    drafter = ServingDrafter(runner.model, model_dir=tiny_dir)
    graphed = DraftProposer(drafter, num_slots=slots, cuda_graphs=True)
    assert graphed.graphs is not None
    eager = DraftProposer(drafter, num_slots=slots)
    rng = random.Random(5)
    g = torch.Generator(device="cuda").manual_seed(5)
    ring = graphed.ring
    counts = [3, 3, 3, 5, 1, 5, 5, 8, 8, 8, 2, 3]
    for call, n in enumerate(counts):
        # new context between calls, in place: a replay must read it
        rows = torch.randn(ring.rows.shape, generator=g, device="cuda").to(ring.rows.dtype)
        tags = torch.randint(-1, 300, ring.tags.shape, generator=g, device="cuda")
        for r in (graphed.ring, eager.ring):
            r.rows.copy_(rows)
            r.tags.copy_(tags)
        ys = [rng.randrange(20, 400) for _ in range(n)]
        anchors = [rng.randrange(10, 300) for _ in range(n)]
        picked = rng.sample(range(slots), n)
        got = graphed.graphs(ys, anchors, picked)
        size = bucket(n, slots)
        want = eager._pass(*(torch.tensor(padded(v, size), dtype=torch.int64, device="cuda")
                             for v in (ys, anchors, picked)))  # fmt: skip
        assert got.tokens.shape == (n, drafter.block_size), call
        assert torch.equal(got.tokens, want.tokens[:n]), call
        assert torch.equal(got.confidence, want.confidence[:n]), call
    stats = graphed.graphs.stats
    # buckets 4, 8, 1, 2: 4 and 8 seen often enough to be captured; 1 and 2 once (eager)
    assert stats.failed == 0 and stats.captures == 2 and stats.replays == 6, stats
