"""`deepinfer` command line: one subcommand per module, each with --help.

A subcommand module exposes ``add_parser(subparsers)`` and ``run(args) -> int``. User errors
raise ``CliError`` and print one line; nothing a user can type ends in a stack trace.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module holding add_parser/run; order is the order --help lists them.
SUBCOMMANDS = {
    "serve": "deepinfer.bin.serve",
    "node": "deepinfer.bin.node",
    "storage": "deepinfer.bin.storage",
    "cluster": "deepinfer.bin.cluster",
    "bench": "deepinfer.bin.bench",
    "make-tiny-model": "deepinfer.bin.tiny_model",
    "train-tiny": "deepinfer.bin.train_tiny",
    "version": "deepinfer.bin.version",
}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class NotBuiltError(CliError):
    """The feature behind a subcommand does not exist yet (exit 2)."""

    def __init__(self, what: str):
        super().__init__(f"not built yet: {what}", code=2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepinfer",
        description="DeepInfer: serving stack for the DeepSeek-V4 model family.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = module.add_parser(subparsers, name)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except CliError as exc:
        print(f"deepinfer {args.command}: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
