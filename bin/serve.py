"""`deepinfer serve`: OpenAI-compatible server (embedded default: gateway + engine + store)."""

from __future__ import annotations

from deepinfer.bin.cli import NotBuiltError


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name,
        help="run the OpenAI-compatible server",
        description="Run the OpenAI-compatible HTTP server. With no --model it serves the built-in tiny model.",
    )
    p.add_argument("--model", default=None, help="HF-style model directory (default: built-in tiny model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    return p


def run(args) -> int:
    raise NotBuiltError("the HTTP gateway and engine ([gateway], [engine-core])")
