"""Load and run the benchmarks of tests/bench as the package ``deepinfer_bench``.

    python tests/bench/package_loader.py NAME [ARGS...]    what `deepinfer bench NAME ARGS` runs

Benchmarks import their siblings as ``deepinfer_bench.<module>`` (``from deepinfer_bench.report
import Report``), so this directory is registered under that name first. Tests load a benchmark
in-process with ``load_bench_module`` (tests/conftest.py re-exports it).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

BENCH_PACKAGE = "deepinfer_bench"
BENCH_DIR = Path(__file__).resolve().parent


def load_bench_package():
    """Register tests/bench as the importable package ``deepinfer_bench`` (idempotent)."""
    if BENCH_PACKAGE in sys.modules:
        return sys.modules[BENCH_PACKAGE]
    spec = importlib.util.spec_from_file_location(BENCH_PACKAGE, BENCH_DIR / "__init__.py",
                                                  submodule_search_locations=[str(BENCH_DIR)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[BENCH_PACKAGE] = module
    spec.loader.exec_module(module)
    return module


def load_bench_module(name: str):
    """Import ``tests/bench/bench_<name>.py`` (or any module path under tests/bench)."""
    load_bench_package()
    module_name = name if "." in name or name.startswith("bench_") else f"bench_{name}"
    return importlib.import_module(f"{BENCH_PACKAGE}.{module_name}")


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: package_loader.py NAME [ARGS...]", file=sys.stderr)
        return 2
    return int(load_bench_module(argv[0]).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
