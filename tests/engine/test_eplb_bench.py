"""`deepinfer bench eplb` on small traces, and the tiny-model routing recorder behind it."""

import json

import numpy as np
import pytest

from tests.conftest import load_bench_module, load_bench_package


def run_bench(argv, tmp_path):
    out = tmp_path / "eplb.json"
    rc = load_bench_module("eplb").main([*argv, "--json", str(out)])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.timeout(120)
def test_bench_synthetic_ours_against_deepseek(tmp_path, capsys):
    rc, data = run_bench(["--traces", "synthetic", "--layers", "2", "--experts", "64", "--prefill-periods", "1",
                          "--decode-periods", "1", "--decode-gpus", "16"], tmp_path)
    assert rc == 0
    printed = capsys.readouterr().out
    for name in ("prefill-ep2", "prefill-ep4", "decode-ep16", "baseline", "static"):
        assert name in printed
    assert data["settings"] == 3
    for setting in ("prefill_ep2", "prefill_ep4", "decode_ep16"):
        ours, base, static = (data[f"synthetic_{setting}_{p}"] for p in ("ours", "baseline", "static"))
        assert 1.0 <= ours < static
        assert 1.0 <= base <= static
    # prefill steps hold a handful of requests each: balancing every step of the window beats
    # balancing its mean by more than a point (seeds 0-3 on this size: 1.2-3.2 points)
    for setting in ("prefill_ep2", "prefill_ep4"):
        assert data[f"synthetic_{setting}_ours"] < data[f"synthetic_{setting}_baseline"] - 0.005
    # decode's thousands of sequences leave sampling noise and drift: the planners are within
    # half a point; ours re-places when the load drifts, the baseline waits for its period
    assert data["synthetic_decode_ep16_ours"] < data["synthetic_decode_ep16_baseline"] + 0.005
    assert data["synthetic_decode_ep16_ours_plans"] >= data["synthetic_decode_ep16_baseline_plans"]
    # the least-loaded dispatch over ours' placements (prefill sizes): below the even split
    for setting in ("prefill_ep2", "prefill_ep4"):
        assert 1.0 <= data[f"synthetic_{setting}_ours_least_loaded"] < data[f"synthetic_{setting}_ours"]
    assert "synthetic_decode_ep16_ours_least_loaded" not in data
    settings = ("prefill_ep2", "prefill_ep4", "decode_ep16")
    assert data["realised_imbalance"] == max(data[f"synthetic_{s}_ours"] for s in settings)
    assert data["plan_ms_ours"] > 0 and data["plan_ms_baseline"] > 0


def write_trace(path, steps=300, layers=2, experts=16, seed=0):
    load_bench_package()
    from deepinfer_bench.eplb.synthetic import SyntheticTrace, prefill_config

    trace = SyntheticTrace(prefill_config(steps, 2, num_layers=layers, num_experts=experts, top_k=4, seed=seed,
                                          chunk_tokens=2048))
    np.save(path, np.concatenate(list(trace.chunks())))


@pytest.mark.timeout(120)
def test_bench_replays_a_trace_file(tmp_path):
    path = tmp_path / "trace.npy"
    write_trace(path)
    rc, data = run_bench(["--trace", str(path), "--gpus", "4", "--redundant-per-gpu", "2", "--window", "20",
                          "--period", "100"], tmp_path)
    assert rc == 0
    assert data["settings"] == 1
    assert data["realised_imbalance"] == data["file_ep4_ours"]
    assert data["baseline_imbalance"] == data["file_ep4_baseline"]
    assert data["file_ep4_ours"] <= data["file_ep4_ours_worst_period"]
    assert 1.0 <= data["file_ep4_ours"] < data["file_ep4_static"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make, argv, message", [
    (None, ["--trace", "{dir}/missing.npy", "--gpus", "2", "--redundant-per-gpu", "1", "--window", "5", "--period", "9"],
     "cannot read"),
    ("2d", ["--trace", "{path}", "--gpus", "2", "--redundant-per-gpu", "1", "--window", "5", "--period", "9"],
     "want a numeric array [steps, layers, experts]"),
    ("negative", ["--trace", "{path}", "--gpus", "2", "--redundant-per-gpu", "1", "--window", "5", "--period", "9"],
     "finite and non-negative"),
    ("late-nan", ["--trace", "{path}", "--gpus", "2", "--redundant-per-gpu", "1", "--window", "5", "--period", "9"],
     "steps 1000 onwards"),
    ("ok", ["--trace", "{path}", "--gpus", "3", "--redundant-per-gpu", "1", "--window", "5", "--period", "9"],
     "do not split evenly over 3 GPUs"),
    ("ok", ["--trace", "{path}", "--gpus", "2", "--redundant-per-gpu", "1", "--window", "500", "--period", "9"],
     "not more than the window"),
    ("ok", ["--trace", "{path}", "--gpus", "2", "--window", "5", "--period", "9"], "--trace needs --redundant-per-gpu"),
])  # fmt: skip
def test_bench_rejects_bad_traces_and_settings(tmp_path, capsys, make, argv, message):
    path = tmp_path / "trace.npy"
    if make == "2d":
        np.save(path, np.ones((10, 16)))
    elif make == "negative":
        np.save(path, -np.ones((10, 1, 16)))
    elif make == "late-nan":  # found while replaying, past the first chunk
        trace = np.ones((1500, 1, 16))
        trace[1200, 0, 3] = np.nan
        np.save(path, trace)
    elif make == "ok":
        np.save(path, np.ones((50, 1, 16)))
    argv = [a.format(dir=tmp_path, path=path) for a in argv]
    rc, _ = run_bench(argv, tmp_path)
    assert rc == 2
    line = capsys.readouterr().out.strip()
    assert line.startswith("deepinfer bench eplb: ") and message in line and "\n" not in line


@pytest.mark.timeout(120)
def test_tiny_model_recorder_counts_every_routed_token():
    load_bench_package()
    from deepinfer_bench.eplb.tiny_trace import record

    prefill, decode = record(prefill_steps=4, decode_steps=6, chunk_tokens=128, num_seqs=4)
    assert prefill.shape == (4, 4, 16) and decode.shape == (6, 4, 16)
    tokens = {}
    for name, trace in (("prefill", prefill), ("decode", decode)):
        per_layer = trace.sum(axis=2)  # [steps, layers]: tokens * top-4 in every layer alike
        assert (per_layer == per_layer[:, :1]).all()
        tokens[name] = per_layer[:, 0] / 4
        assert (tokens[name] == np.round(tokens[name])).all() and (tokens[name] >= 1).all()
        assert (tokens[name] <= 128).all()  # the step's token budget
    assert (tokens["prefill"][:3] == 128).all()  # full chunks before the last step
    assert tokens["decode"][0] <= 4  # from the first step without prompt tokens: one per sequence
