"""`deepinfer make-tiny-model`: write a small deterministic checkpoint for tests and `serve`."""

from __future__ import annotations

from deepinfer.bin.cli import NotBuiltError


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name,
        help="write a tiny random checkpoint directory",
        description="Write a complete, deterministic tiny checkpoint (config, safetensors, tokenizer).",
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--arch", default="deepseek_v4", choices=["deepseek_v4"], help="model architecture")
    p.add_argument("--seed", type=int, default=0, help="random seed for the weights")
    return p


def run(args) -> int:
    raise NotBuiltError("make-tiny-model ([model-v4])")
