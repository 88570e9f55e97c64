"""Benchmarks, importable as the package ``deepinfer_bench`` (see deepinfer/bin/bench.py)."""
