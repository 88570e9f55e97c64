"""`deepinfer bench NAME ...`: run a benchmark from tests/bench/ in a process of its own.

Benchmarks live in the source checkout (``tests/bench/bench_NAME.py``, each with
``main(argv) -> int``), not in the installed package: this command runs
``python tests/bench/package_loader.py NAME ARGS...`` (which registers tests/bench as the package
``deepinfer_bench`` so a benchmark can import its siblings) and returns its exit status. Every
benchmark prints a table on stdout and, with ``--json PATH``, writes a flat JSON object of figures.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deepinfer.bin.cli import CliError

LOADER = "package_loader.py"  # tests/bench/package_loader.py: registers the package, runs main(argv)

# name -> one-line description (the module is tests/bench/bench_<name>.py)
BENCHES = {
    "transport": "bulk data-plane throughput over ipc/tcp next to memcpy",
    "engine": "scheduler overhead, async overlap, cost model error, tokens/s vs transformers",
    "model": "DeepSeek-V4 forward tokens/s vs transformers on the same tiny weights",
    "serve": "load generator against a running OpenAI-compatible server",
    "store": "erasure coding and storage-cluster put/get throughput",
    "swa": "exact vs bounded SWA replay: cost and quality",
    "pd": "prefill/decode disaggregation vs co-located: TTFT, ITL, handoff GB/s",
    "balance": "cluster simulator: balancers against baselines on one trace",
    "eplb": "expert-parallel load balancer vs DeepSeek's EPLB: realised imbalance on routing traces",
    "spec": "DSpark verify lengths: off / fixed-5 / confidence schedule (engine on the tiny model, or --simulated)",
    "gpu": "V4 on one NVIDIA GPU vs transformers: tokens/s b1/16/64, roofline, 8K prefill, launches/token",
    "graphs": "CUDA-graph signatures of a generate's forwards (GPU contexts built on the CPU): replays vs eager",
}


def bench_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "tests" / "bench"


def add_parser(subparsers, name):
    lines = "\n".join(f"  {k:<10} {v}" for k, v in BENCHES.items())
    p = subparsers.add_parser(
        name,
        help="run a benchmark (table on stdout, --json PATH for figures)",
        description=f"Run a benchmark. Available:\n{lines}\n\n`deepinfer bench NAME --help` lists its options.",
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    p.add_argument("bench", choices=sorted(BENCHES), metavar="NAME", help="benchmark to run")
    p.add_argument("bench_args", nargs=__import__("argparse").REMAINDER, help="options for the benchmark")
    return p


def run(args) -> int:
    root = bench_dir()
    if not (root / LOADER).is_file():
        raise CliError(f"benchmarks ship with the source checkout; {root} is missing")
    path = root / f"bench_{args.bench}.py"
    if not path.exists():
        raise CliError(f"not built yet: benchmark {args.bench!r} ({path.name} is missing)", code=2)
    return subprocess.call([sys.executable, str(root / LOADER), args.bench, *args.bench_args])
