"""CUDA-graph signatures of the engine's forwards, counted on the CPU (`deepinfer bench graphs`).

A CUDA graph replays only a forward whose context has the signature it was captured with
(engine/core/cuda_graphs.py: every tensor's dtype and shape and every plain field of the context
tree). A signature seen once runs eagerly; the second sighting captures; only later ones replay.
So how many distinct signatures a workload's forwards make, and how often each recurs, decides
how much of a GPU run is eager launches and captures.

This bench runs one generate on the CPU and builds, beside each forward's own context, the context
the model would build on a GPU that replays graphs (``Geometry.compact_candidates``, the GPU's
token-group size, one group per layer kind for decode and verify steps: ``merge_step_tokens``;
padded entries and step pools: ``dump_block``; the runner's padding steps: ``graph_batch``; and
DSpark's verify buckets, unless ``--no-buckets``), then reports: forwards, distinct signatures, forwards that would replay (a signature's third
sighting on), those seen once, and which context fields changed most often between consecutive
forwards whose signatures differ. Any concurrency and speculation mode (``--speculative off |
fixed | confidence | throughput``), on the built-in trained tiny V4.1 or any model directory.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path

import torch

from deepinfer import envs
from deepinfer.engine.core.model_runner import graph_batch
from deepinfer.engine.models.deepseek_v4.context import group_key_rows, merge_step_tokens
from deepinfer_bench.report import Report, base_parser

MODES = ("off", "fixed", "confidence", "throughput")
GPU = torch.device("cuda")  # only named: the geometry functions' answer for a model on a GPU


def field_paths(obj, path: str = "ctx", out: list[str] | None = None) -> list[str]:
    """One name per signature entry, in the order cuda_graphs' walk appends them."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(path)
    elif dataclasses.is_dataclass(obj):
        out.append(path)
        for f in dataclasses.fields(obj):
            field_paths(getattr(obj, f.name), f"{path}.{f.name}", out)
    elif isinstance(obj, list):
        out.append(f"{path}[]")
        for i, value in enumerate(obj):
            field_paths(value, f"{path}[{i}]", out)
    elif isinstance(obj, dict):
        out.append(f"{path}{{}}")
        for key, value in obj.items():
            field_paths(value, f"{path}[{key}]", out)
    else:
        out.append(path)
    return out


def gpu_geometry(geometry, dump_block: int):
    """The geometry the same model builds on a GPU that replays CUDA graphs (V4's ``Geometry`` or
    V4.1's wrapper of it); ``dump_block``: the block cache's."""
    def on_gpu(base):
        return dataclasses.replace(base, compact_candidates=True, max_group_key_rows=group_key_rows(GPU),
                                   merge_step_tokens=merge_step_tokens(GPU), dump_block=dump_block)

    if hasattr(geometry, "base"):
        return dataclasses.replace(geometry, base=on_gpu(geometry.base))
    return on_gpu(geometry)


class SignatureLog:
    """Wraps a runner's context builder: each forward's GPU signature and field names."""

    def __init__(self, runner):
        from deepinfer.engine.core import cuda_graphs

        self.signatures: list[tuple | None] = []
        self.names: list[list[str]] = []
        build = runner._build_context

        def built(batch, geometry, **kw):
            ctx = build(batch, geometry, **kw)
            gpu_geo = gpu_geometry(geometry, runner.blocks.dump_block)
            # the batch a graphed runner runs (padding steps, model_runner.graph_batch)
            padded = graph_batch(batch, gpu_geo, runner.swa.dump_slot, runner.blocks.dump_block,
                                 envs.get().cuda_graph_max_tokens)
            gpu_ctx = build(padded, gpu_geo, **kw)
            lay = cuda_graphs.layout(gpu_ctx)
            self.signatures.append(None if lay is None else lay.signature)
            self.names.append(field_paths(gpu_ctx))
            return ctx

        runner._build_context = built

    def clear(self) -> None:
        self.signatures.clear()
        self.names.clear()

    def summary(self, top: int) -> dict:
        sigs = self.signatures
        counts = collections.Counter(s for s in sigs if s is not None)
        replays = sum(max(0, n - 2) for n in counts.values())
        changed = collections.Counter()
        for i, (a, b) in enumerate(zip(sigs, sigs[1:])):
            if a is None or b is None or a == b:
                continue
            if len(a) != len(b):
                changed["(the context's structure: groups, kinds or entries present)"] += 1
                continue
            names = self.names[i]
            for field in sorted({names[j] for j in range(len(a)) if a[j] != b[j] and j < len(names)}):
                changed[field] += 1
        return dict(forwards=len(sigs), distinct=len(counts), ungraphable=sum(s is None for s in sigs),
                    seen_once=sum(1 for n in counts.values() if n == 1), replays=replays,
                    changed=changed.most_common(top))


def build_parser():
    p = base_parser("graphs", __doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the trained tiny V4.1 in the package)")
    p.add_argument("--concurrency", type=int, default=1, help="requests submitted at once (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default %(default)s)")
    p.add_argument("--speculative", choices=MODES, default="off",
                   help="off, or DSpark with this verify schedule (default %(default)s)")
    p.add_argument("--top", type=int, default=8, help="context fields listed (default %(default)s)")
    p.add_argument("--no-buckets", action="store_true",
                   help="verify steps not padded to token buckets (a GPU pads them: engine/spec/decoding.py)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.concurrency < 1 or args.max_tokens < 1 or args.top < 1:
        raise SystemExit("deepinfer bench graphs: --concurrency, --max-tokens and --top must be >= 1")
    import deepinfer
    from deepinfer import LLM, SamplingParams
    from deepinfer_bench.spec_engine import prompts_of

    model = Path(args.model) if args.model else Path(deepinfer.__file__).parent / "engine/models/deepseek_v41/builtin"
    if not model.is_dir():
        raise SystemExit(f"deepinfer bench graphs: no model directory {model}")
    spec = {} if args.speculative == "off" else dict(speculative="dspark", spec_schedule=args.speculative)
    started = time.perf_counter()
    llm = LLM(str(model), max_num_seqs=max(args.concurrency, 1), max_model_len=512, seed=0, **spec)
    try:
        log = SignatureLog(llm.engine.core.runner)
        spec_part = llm.engine.core.spec
        if spec_part is not None and spec_part.config.schedule != "fixed":
            spec_part.pad_to_buckets = not args.no_buckets  # as on a GPU (engine/spec/decoding.py)
        prompts = prompts_of(model, args.concurrency)
        log.clear()
        llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        llm.shutdown()
    got = log.summary(args.top)
    report = Report(f"graphs: CUDA-graph signatures of one generate ({args.concurrency} requests x {args.max_tokens} "
                    f"tokens, speculative {args.speculative}), the GPU's context built on the CPU")
    for field, times in got["changed"]:
        report.row(field=field, changed=times)
    for key in ("forwards", "distinct", "seen_once", "replays", "ungraphable"):
        report.figure(key, got[key])
    report.figure("replay_share", got["replays"] / max(got["forwards"], 1))
    report.figure("wall_s", time.perf_counter() - started)
    report.finish(args.json)
    return 0
