"""Load an official V4.1 checkpoint directory into canonical tensors (the float path's weights).

    model_dir/
      config.json          nested text_config / vision_config / quantization_config
      *.safetensors        official names (no ``model.`` prefix), one file or shards + index
      tokenizer.json       Engram's compressed vocabulary is built from it

FP8 E4M3 linears (``X.weight`` + ``X.scale``, one UE8M0 scale per [32, 32] block, the block from
``quantization_config.weight_block_size``) and MXFP4 experts (int8 pairs + one scale per 32) are
dequantised exactly to the compute dtype. The Engram table stays as stored (FP8 rows with one
scale per 32 values, dequantised on lookup; its scale comes back as float32 multipliers).
The vision tower's tensors are recognised and left to vision_weights.py
(``LoadedV41.num_vision_tensors``); the routers' image biases load with the text model. Names, shapes,
scales and coverage are checked from the headers before any data is read; every failure is a
one-line ``CheckpointError`` naming the tensor.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.engine.loader.dequant import QuantFormatError, dequant_fp4, dequant_fp8, scale_to_float
from deepinfer.engine.loader.weights import CheckpointError, resolve_dtype, weight_files
from deepinfer.engine.models.deepseek_v4.checkpoint_names import ExpertSlice
from deepinfer.engine.loader.config_fields import ModelConfigError
from deepinfer.engine.models.deepseek_v41 import checkpoint_names as names
from deepinfer.engine.models.deepseek_v41.config import V41Config
from deepinfer.engine.models.deepseek_v41.engram import EngramError, token_map_from_dir

_PACKED_FP4 = ("I8", "U8", "F4")
_NEEDS_SCALE = ("F8_E4M3", "F8_E5M2", *_PACKED_FP4)


@dataclass(slots=True)
class _Stored:
    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]


@dataclass(slots=True)
class LoadedV41:
    config: V41Config
    tensors: dict[str, torch.Tensor]  # canonical name -> tensor (the model's state_dict)
    num_vision_tensors: int  # recognised and left for the vision tower


def load_v41_checkpoint(model_dir: str | Path, dtype: torch.dtype | str = torch.float32,
                        device: str | torch.device = "cpu") -> LoadedV41:
    model_dir = Path(model_dir)
    try:
        cfg = V41Config.from_dir(model_dir)
        expected = names.canonical_shapes(cfg)
    except (ModelConfigError, EngramError) as exc:
        raise CheckpointError(str(exc)) from None
    compute = resolve_dtype(dtype, cfg)
    stored = _headers(weight_files(model_dir))
    plan, num_vision = _plan(stored, expected, cfg, model_dir)
    tensors = _read(plan, expected, cfg, compute, torch.device(device), model_dir)
    if names.TOKEN_MAP in expected:
        try:
            tensors[names.TOKEN_MAP] = token_map_from_dir(model_dir, cfg.vocab_size, cfg.engram_compressed_vocab_size,
                                                          cfg.engram_pad_token_id).to(device)
        except EngramError as exc:
            raise CheckpointError(str(exc)) from None
    if cfg.tie_word_embeddings and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    return LoadedV41(cfg, tensors, num_vision)


def _headers(files: list[Path]) -> dict[str, _Stored]:
    stored: dict[str, _Stored] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key in stored:
                        raise CheckpointError(f"tensor {key!r} is in both {stored[key].file.name} and {path.name}")
                    s = f.get_slice(key)
                    stored[key] = _Stored(key, path, s.get_dtype(), tuple(s.get_shape()))
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
    return stored


def _plan(stored: dict[str, _Stored], expected: dict[str, tuple[int, ...]], cfg: V41Config, model_dir: Path):
    """[(stored weight, canonical target, stored scale or None)], vision tensor count."""
    scales = {k for k in stored if k.endswith(".scale") and k[: -len("scale")] + "weight" in stored}
    plan, seen, num_vision = [], {}, 0
    for key, item in stored.items():
        if key.startswith("model."):
            raise CheckpointError(f"tensor {key!r} in {model_dir} has a 'model.' prefix; official V4.1 checkpoints "
                                  "name tensors without it")
        if names.is_vision(key, cfg):
            num_vision += 1
            continue
        if key in scales:
            continue
        target = names.to_canonical(key)
        scale = stored.get(key[: -len("weight")] + "scale") if key.endswith(".weight") else None
        table = isinstance(target, str) and bool(names.ENGRAM_TABLE.search(target))
        if scale is None and item.dtype in _NEEDS_SCALE:
            raise CheckpointError(f"tensor {key!r} in {model_dir} is stored as {item.dtype} but has no .scale next to it")
        shape = item.shape
        if scale is not None and item.dtype in _PACKED_FP4:
            shape = (*shape[:-1], 2 * shape[-1])
        name = target.target if isinstance(target, ExpertSlice) else target
        if name not in expected and key.endswith(".scale"):
            raise CheckpointError(f"tensor {key!r} in {model_dir} is a block scale without its weight "
                                  f"{key[: -len('scale')] + 'weight'!r}")
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {key!r} in {model_dir}: the model its config.json describes has "
                                  "no such weight")
        want = expected[name]
        if isinstance(target, ExpertSlice):
            if target.expert >= want[0]:
                raise CheckpointError(f"tensor {key!r} in {model_dir} is expert {target.expert}; the layer has "
                                      f"{want[0]} experts")
            want = (want[1] // 2, want[2]) if target.part in ("gate", "up") else want[1:]
        if tuple(shape) != tuple(want):
            raise CheckpointError(f"tensor {key!r} in {model_dir} has shape {tuple(shape)}, the model expects "
                                  f"{tuple(want)}")
        if table and (item.dtype == "F8_E4M3") != (cfg.quantization is not None):
            raise CheckpointError(f"tensor {key!r} in {model_dir} is stored as {item.dtype}, but the config "
                                  f"{'has' if cfg.quantization else 'has no'} quantization_config")
        ident = (name, target.expert, target.part) if isinstance(target, ExpertSlice) else name
        if ident in seen:
            raise CheckpointError(f"tensors {seen[ident]!r} and {key!r} in {model_dir} are the same weight")
        seen[ident] = key
        plan.append((item, target, None if table else scale))
        if table and scale is not None:
            plan.append((scale, names.to_canonical(scale.key), None))
            seen[names.to_canonical(scale.key)] = scale.key
    _check_coverage(seen, expected, cfg, model_dir)
    return plan, num_vision


def _check_coverage(seen: dict, expected: dict[str, tuple[int, ...]], cfg: V41Config, model_dir: Path) -> None:
    for name, shape in expected.items():
        if name == names.TOKEN_MAP or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if name.endswith(".engram.embed_scale") and cfg.quantization is None:
            continue  # an unquantised table has no scale
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            parts = ("down",) if name.endswith("down_proj") else ("gate", "up")
            for expert in range(shape[0]):
                for part in parts:
                    if (name, expert, part) not in seen:
                        raise CheckpointError(f"checkpoint {model_dir} is missing expert {expert} {part} of {name!r}")
        elif name not in seen:
            raise CheckpointError(f"checkpoint {model_dir} is missing tensor {name!r}")


def _read(plan, expected, cfg: V41Config, dtype: torch.dtype, device: torch.device, model_dir: Path):
    block = tuple((cfg.quantization or {}).get("weight_block_size", (32, 32)))
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        if name.endswith(".engram.embed_scale"):
            tensors[name] = torch.ones(shape, dtype=torch.float32, device=device)  # replaced if stored
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(item: _Stored) -> torch.Tensor:
            if item.file not in handles:
                handles[item.file] = stack.enter_context(safe_open(str(item.file), framework="pt", device="cpu"))
            return handles[item.file].get_tensor(item.key)

        for item, target, scale in sorted(plan, key=lambda p: (str(p[0].file), p[0].key)):
            name = target.target if isinstance(target, ExpertSlice) else target
            out_dtype = torch.float32 if names.keeps_fp32(name) else dtype
            t = read(item)
            if scale is not None:
                try:
                    t = dequant_fp4(t, read(scale), out_dtype) if item.dtype in _PACKED_FP4 else \
                        dequant_fp8(t, read(scale), block, out_dtype)
                except QuantFormatError as exc:
                    raise CheckpointError(f"tensor {item.key!r} in {model_dir}: {exc}") from None
            elif name.endswith(".engram.embed_scale"):
                t = scale_to_float(t)
            elif t.is_floating_point() and not names.ENGRAM_TABLE.search(name):
                t = t.to(out_dtype)
            t = t.to(device)
            if isinstance(target, ExpertSlice):
                merged = tensors.get(name)
                if merged is None:
                    merged = tensors[name] = torch.empty(expected[name], dtype=out_dtype, device=device)
                rows = expected[name][1] // 2
                part = {"gate": slice(0, rows), "up": slice(rows, None), "down": slice(None)}[target.part]
                merged[target.expert, part] = t
            else:
                tensors[name] = t.contiguous()
    return tensors
