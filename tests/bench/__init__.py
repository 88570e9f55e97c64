"""Benchmarks, importable as the package ``deepinfer_bench`` (see tests/bench/package_loader.py)."""
