"""`deepinfer bench NAME ...`: run a benchmark from tests/bench/.

Benchmarks live in the source checkout (``tests/bench/bench_NAME.py``, each with
``main(argv) -> int``). They are loaded as the package ``deepinfer_bench`` so a benchmark
can import its siblings (``from deepinfer_bench.report import Report``). Every benchmark
prints a table on stdout and, with ``--json PATH``, writes a flat JSON object of figures.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from deepinfer.bin.cli import CliError

BENCH_PACKAGE = "deepinfer_bench"

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
    "spec": "DSpark verify lengths: off / fixed-5 / confidence schedule (--simulated drafter)",
}


def bench_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "tests" / "bench"


def load_bench_package():
    """Register tests/bench as the importable package ``deepinfer_bench`` (idempotent)."""
    if BENCH_PACKAGE in sys.modules:
        return sys.modules[BENCH_PACKAGE]
    root = bench_dir()
    init = root / "__init__.py"
    if not init.exists():
        raise CliError(f"benchmarks ship with the source checkout; {root} is missing")
    spec = importlib.util.spec_from_file_location(BENCH_PACKAGE, init, submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[BENCH_PACKAGE] = module
    spec.loader.exec_module(module)
    return module


def load_bench_module(name: str):
    """Import ``tests/bench/bench_<name>.py`` (or any module path under tests/bench)."""
    load_bench_package()
    module_name = name if "." in name or name.startswith("bench_") else f"bench_{name}"
    return importlib.import_module(f"{BENCH_PACKAGE}.{module_name}")


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
    path = bench_dir() / f"bench_{args.bench}.py"
    if not path.exists():
        raise CliError(f"not built yet: benchmark {args.bench!r} ({path.name} is missing)", code=2)
    module = load_bench_module(args.bench)
    return int(module.main(args.bench_args) or 0)
