"""`deepinfer bench graphs`: the CUDA-graph signatures of a generate's forwards, with the GPU's
context built on the CPU."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_bench_module

pytestmark = pytest.mark.timeout(180)


def test_field_names_line_up_with_the_signature():
    """Each signature entry gets the name of the context field it came from (the bench's table
    of changed fields depends on it): a V4 decode context of two sequences, GPU geometry."""
    from deepinfer.engine.core import cuda_graphs
    from deepinfer.engine.core.batch import ForwardBatch, SeqStep
    from deepinfer.engine.core.model_runner import ModelRunner
    from deepinfer.engine.models.deepseek_v4.tiny_model import init_weights, tiny_config

    bench = load_bench_module("graphs")
    cfg = tiny_config()
    runner = ModelRunner(cfg, init_weights(cfg, seed=0), num_blocks=8, num_slots=2, block_size=128,
                         batch_invariant=False)
    batch = ForwardBatch([SeqStep(0, 0, [0, 1], 150, [5], 1), SeqStep(1, 1, [2, 3], 40, [6, 7], 2)])
    ctx = runner._build_context(batch, bench.gpu_geometry(runner.geometry, runner.blocks.dump_block), device=runner.device,
                                batch_invariant=False)
    names = bench.field_paths(ctx)
    signature = cuda_graphs.layout(ctx).signature
    assert len(names) == len(signature)
    assert names[0] == "ctx" and any(n.endswith(".token_ids") for n in names)
    for name, entry in zip(names, signature):
        if isinstance(entry, tuple) and len(entry) == 2 and hasattr(entry[0], "is_floating_point"):
            assert "." in name  # a tensor entry is a field of the tree, not a container marker


def test_bench_graphs_counts_one_generate(tmp_path, capsys):
    bench = load_bench_module("graphs")
    out = tmp_path / "graphs.json"
    assert bench.main(["--concurrency", "2", "--max-tokens", "12", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    # 1 prefill forward + 11 decode forwards (the first token comes from the prefill)
    assert got["forwards"] == 12 and got["ungraphable"] == 0
    assert 1 <= got["seen_once"] <= got["distinct"] < got["forwards"]
    assert got["replays"] == got["forwards"] - got["distinct"] - (got["distinct"] - got["seen_once"])
    assert "signatures" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="must be >= 1"):
        bench.main(["--concurrency", "0"])
