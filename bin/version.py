"""`deepinfer version`: print the package version (and torch's, when asked)."""

from __future__ import annotations

import deepinfer


def add_parser(subparsers, name):
    p = subparsers.add_parser(name, help="print the DeepInfer version", description="Print the DeepInfer version.")
    p.add_argument("--verbose", action="store_true", help="also print the versions of the main dependencies")
    return p


def run(args) -> int:
    print(f"deepinfer {deepinfer.__version__}")
    if args.verbose:
        import importlib.metadata as md

        for dist in ("torch", "pyzmq", "msgspec", "aiohttp", "uvloop", "xgrammar", "pyeclib"):
            try:
                print(f"{dist} {md.version(dist)}")
            except md.PackageNotFoundError:
                print(f"{dist} (not installed)")
    return 0
