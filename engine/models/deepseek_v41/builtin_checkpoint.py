"""The trained tiny DeepSeek-V4.1 checkpoint shipped in the package (``builtin/``), served by default.

Trained by `deepinfer train-tiny` (engine/models/deepseek_v41/training/) on the Python standard
library: config.json, model.safetensors (official layout, FP8/FP4), tokenizer.json,
tokenizer_config.json (chat template), dspark_calibration.json (the confidence head's
temperatures), eval.json (the figures of the README section) and heldout_headers.json (held-out
function headers the tests complete).
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_DIR = Path(__file__).with_name("builtin")
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def builtin_checkpoint() -> Path | None:
    """The shipped checkpoint directory, or None when this tree does not carry it complete."""
    if all((BUILTIN_DIR / name).is_file() for name in REQUIRED):
        return BUILTIN_DIR
    return None
