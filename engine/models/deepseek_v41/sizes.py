"""Cache sizes of a V4.1 config in DeepSeek's released formats (computed from the config, nothing allocated).

Global (paged, prefix-cacheable) cache: per kv-source layer of ratio r, one compressed row and one
index key per r tokens:

    compressed row   head_dim e2m1 values packed two per byte + one E4M3 scale per 16   (512 -> 288 B)
    index key        index_head_dim e2m1 + one UE8M0 scale per 32                     (128 -> 68 B)

SWA slot (per sequence, never paged): DeepSeek persists the window rows of the layers below the
CED source (window-only + encoder layers), ``sliding_window + lookahead`` rows each, in MXFP8:
head_dim e4m3 values + one UE8M0 scale per 32 (512 -> 528 B). V4.1-Flash: 890 B per token and
20 x 134 x 528 = 1,415,040 B per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.engine.models.deepseek_v41.config import V41Config

DEFAULT_LOOKAHEAD = 6  # 5 DSpark drafts + 1 bonus token


def fp4_row_bytes(width: int, group: int) -> int:
    return width // 2 + width // group


def mxfp8_row_bytes(width: int) -> int:
    return width + width // 32


@dataclass(frozen=True, slots=True)
class CacheSizes:
    global_bytes_per_token: float  # official formats, all kv sources
    float_bytes_per_token: float  # the float path's bf16 rows and keys
    persisted_layers: int  # layers whose window rows the slot persists
    slot_rows: int  # sliding_window + lookahead
    window_row_bytes: int  # MXFP8
    slot_bytes: int  # persisted_layers x slot_rows x window_row_bytes


def cache_sizes(c: V41Config, lookahead: int = DEFAULT_LOOKAHEAD) -> CacheSizes:
    per_token = float_per_token = 0.0
    row, key = fp4_row_bytes(c.head_dim, 16), fp4_row_bytes(c.index_head_dim, 32)
    for role in c.roles:
        if role.is_kv_source:
            per_token += (row + key) / role.ratio
            float_per_token += 2 * (c.head_dim + c.index_head_dim) / role.ratio
    persisted = c.ced_source if c.ced_source is not None else c.num_hidden_layers
    rows = c.sliding_window + lookahead
    window_row = mxfp8_row_bytes(c.head_dim)
    return CacheSizes(per_token, float_per_token, persisted, rows, window_row, persisted * rows * window_row)
