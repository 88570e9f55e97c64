"""Load a V4 checkpoint directory into canonical tensors.

    model_dir/
      config.json                       transformers' or DeepSeek's field names (ModelConfig)
      model.safetensors                 one file, or
      model-0000K-of-0000N.safetensors  shards listed by model.safetensors.index.json

Tensor names may be transformers' (with or without ``model.``) or DeepSeek's
(``layers.L.attn.wq_a.weight``, per-expert ``ffn.experts.E.w1.weight``, ...). FP8 weights with
block scales (``X.scale`` or ``X.weight_scale_inv``) and packed MXFP4 experts are dequantised to
the compute dtype. Everything is checked against the expected names and shapes from the headers
alone, before any tensor data is read, so a malformed directory fails fast with one line naming
the tensor. Data is then read shard by shard; merged expert tensors are filled in place, so
nothing is held twice.
"""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from deepinfer.engine.loader.config_fields import ModelConfigError
from deepinfer.engine.loader.dequant import QuantFormatError, dequantize
from deepinfer.engine.loader.quant_config import DEFAULT_BLOCK

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PACKED_FP4_DTYPES = ("I8", "U8")  # the header shape counts bytes: two values per byte
_NEEDS_SCALE_DTYPES = ("F8_E4M3", "F8_E5M2", "F4")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """The checkpoint directory is unusable; the one-line message names the file or tensor."""


@dataclass(slots=True)
class _Stored:
    key: str  # name inside the file
    file: Path
    dtype: str  # safetensors dtype code ("BF16", "F8_E4M3", "F4", ...)
    shape: tuple[int, ...]


class CheckpointNames(Protocol):
    """A family's tensor naming (e.g. engine/models/deepseek_v4/checkpoint_names.py): a stored name
    -> its canonical name, or an ``ExpertSlice`` (one expert's part of a merged expert tensor)."""

    def to_canonical(self, name: str) -> Any: ...

    def canonical_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]: ...

    def is_fp32_param(self, name: str) -> bool: ...

    def is_mtp(self, name: str) -> bool: ...


@dataclass(slots=True)
class _Entry:
    stored: _Stored
    target: Any  # canonical name (str) or an ExpertSlice (target, expert, part)
    scale: _Stored | None
    shape: tuple[int, ...]  # after dequantisation / unpacking


def load_checkpoint(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    expected: dict[str, tuple[int, ...]] | None = None,
    progress: bool = True,
    names: CheckpointNames | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Read ``model_dir`` -> (config, canonical name -> tensor on ``device``).

    The config comes from the model registry (engine/models/registry.py), the tensor naming from
    ``names`` (default: the family's ``checkpoint_names``). Floating tensors come back in
    ``dtype``, except the precision-critical small ones (``names.is_fp32_param``: mHC weights,
    sinks, norms, position and router biases), which stay float32 as in transformers; ``tid2eid``
    comes back as int64. ``expected`` (the model's own state_dict shapes) defaults to the shapes
    the config implies.
    """
    from deepinfer.engine.models.registry import family, read_model_config

    model_dir = Path(model_dir)
    try:
        cfg = read_model_config(model_dir)
        if names is None:
            family_names = family(cfg.model_type).checkpoint_names
            if family_names is None:
                raise ModelConfigError(f"model_type {cfg.model_type!r} loads its checkpoints with its own loader")
            names = family_names()
    except ModelConfigError as exc:
        raise CheckpointError(str(exc)) from None
    compute_dtype = resolve_dtype(dtype, cfg)
    expected = dict(names.canonical_shapes(cfg) if expected is None else expected)
    stored = _read_headers(weight_files(model_dir))
    entries = _plan(stored, expected, model_dir, names)
    _check_coverage(entries, expected, cfg, model_dir)
    block = tuple((cfg.quantization or {}).get("weight_block_size", DEFAULT_BLOCK))
    tensors = _load(entries, expected, compute_dtype, torch.device(device), block, progress, model_dir, names)
    if "lm_head.weight" in expected and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]  # tied embeddings (checked above)
    return cfg, tensors


def _is_slice(target) -> bool:
    """An ExpertSlice (one expert's gate/up/down of a merged tensor), not a whole tensor's name."""
    return not isinstance(target, str)


def resolve_dtype(dtype: torch.dtype | str, cfg) -> torch.dtype:
    """A torch dtype from a dtype or its name; "auto" = the checkpoint's dtype (float32 if unknown)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (cfg.checkpoint_dtype or "float32") if dtype == "auto" else dtype
    resolved = getattr(torch, _DTYPE_ALIASES.get(str(name), str(name)), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise CheckpointError(f"dtype {dtype!r} is not a floating torch dtype; use float32, bfloat16, float16 or auto")
    return resolved


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of ``model_dir``: the index's shards, the single file, or every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from None
        names = sorted(set(weight_map.values()))
        for name in names:
            if not (model_dir / name).is_file():
                raise CheckpointError(f"{INDEX_FILE} in {model_dir} lists shard {name!r}, which does not exist")
        return [model_dir / name for name in names]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model directory {str(model_dir)!r} has no *.safetensors weight files")
    return files


def _read_headers(files: list[Path]) -> dict[str, _Stored]:
    """Name -> where and what, from the safetensors headers only (no tensor data is read)."""
    stored: dict[str, _Stored] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > _MAX_HEADER_BYTES:
                    raise ValueError(f"header of {length} bytes")
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if key in stored:
                raise CheckpointError(f"tensor {key!r} appears in both {stored[key].file.name} and {path.name}")
            stored[key] = _Stored(key, path, info["dtype"], tuple(info["shape"]))
    return stored


def _scale_owner(key: str, stored: dict[str, _Stored]) -> str | None:
    """The weight a scale tensor belongs to, if ``key`` is one (``X.scale`` / ``X.weight_scale_inv`` /
    ``X_scale_inv``). A ``.scale`` with no ``.weight`` sibling is a parameter (e.g. ``attn_hc.scale``)."""
    for suffix, owner_suffix in ((".weight_scale_inv", ".weight"), ("_scale_inv", ""), (".scale", ".weight")):
        if key.endswith(suffix):
            owner = key[: -len(suffix)] + owner_suffix
            if owner in stored:
                return owner
    return None


def _plan(stored: dict[str, _Stored], expected: dict[str, tuple[int, ...]], model_dir: Path,
          names: CheckpointNames) -> list[_Entry]:
    scale_of = {owner: stored[k] for k in stored if (owner := _scale_owner(k, stored)) is not None}
    scale_keys = {s.key for s in scale_of.values()}
    entries: list[_Entry] = []
    seen: dict[str | tuple[str, int, str], str] = {}
    for key, item in stored.items():
        if key in scale_keys or names.is_mtp(key):
            continue  # scales travel with their weight; MTP layers load with MTP/DSpark
        target = names.to_canonical(key)
        scale = scale_of.get(key)
        if scale is None and item.dtype in _NEEDS_SCALE_DTYPES:
            raise CheckpointError(f"tensor {key!r} in {model_dir} is stored as {item.dtype} but has no scale "
                                  "tensor (.scale or .weight_scale_inv) next to it")
        shape = item.shape
        if scale is not None and item.dtype in _PACKED_FP4_DTYPES:
            shape = (*shape[:-1], 2 * shape[-1])
        seen_key = (target.target, target.expert, target.part) if _is_slice(target) else target
        if seen_key in seen:
            raise CheckpointError(f"tensors {seen[seen_key]!r} and {key!r} in {model_dir} are the same weight")
        seen[seen_key] = key
        _check_shape(key, target, shape, expected, model_dir)
        entries.append(_Entry(item, target, scale, shape))
    return entries


def _check_shape(key: str, target, shape: tuple[int, ...],
                 expected: dict[str, tuple[int, ...]], model_dir: Path) -> None:
    name = target.target if _is_slice(target) else target
    if name not in expected:
        raise CheckpointError(f"unexpected tensor {key!r} in {model_dir}: the model configured by its config.json "
                              "has no such weight")
    want = expected[name]
    if _is_slice(target):
        num_experts, rows, cols = want
        if target.expert >= num_experts:
            raise CheckpointError(f"tensor {key!r} in {model_dir} is expert {target.expert}, but the config has "
                                  f"{num_experts} experts")
        want = (rows // 2, cols) if target.part in ("gate", "up") else (rows, cols)
    if tuple(shape) != tuple(want):
        raise CheckpointError(f"tensor {key!r} in {model_dir} has shape {tuple(shape)}, the model expects "
                              f"{tuple(want)}")


def _check_coverage(entries: list[_Entry], expected: dict[str, tuple[int, ...]], cfg,
                    model_dir: Path) -> None:
    whole = {e.target for e in entries if isinstance(e.target, str)}
    parts: dict[str, set[tuple[int, str]]] = {}
    for e in entries:
        if _is_slice(e.target):
            parts.setdefault(e.target.target, set()).add((e.target.expert, e.target.part))
    missing = []
    for name, shape in expected.items():
        if name in whole:
            if name in parts:
                raise CheckpointError(f"{model_dir} holds {name!r} both merged and per expert")
            continue
        if name in parts:
            kinds = ("down",) if name.endswith("down_proj") else ("gate", "up")
            absent = [(x, k) for x in range(shape[0]) for k in kinds if (x, k) not in parts[name]]
            if absent:
                x, k = absent[0]
                missing.append(f"{name} (expert {x} {k}, {len(absent)} expert matrices in all)")
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings and "embed_tokens.weight" in whole:
            continue
        missing.append(name)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {model_dir} is missing tensor {missing[0]!r}{more}")


def _load(entries: list[_Entry], expected: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device,
          block: tuple[int, int], progress: bool, model_dir: Path, names: CheckpointNames) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    entries = sorted(entries, key=lambda e: (str(e.stored.file), e.stored.key))
    with contextlib.ExitStack() as stack, tqdm(
        total=len(entries), desc=f"Loading {model_dir.name}", unit="tensor", disable=not progress
    ) as bar:
        handles: dict[Path, object] = {}

        def read(item: _Stored) -> torch.Tensor:
            if item.file not in handles:
                handles[item.file] = stack.enter_context(safe_open(str(item.file), framework="pt", device="cpu"))
            return handles[item.file].get_tensor(item.key).to(device)

        for e in entries:
            name = e.target.target if _is_slice(e.target) else e.target
            out_dtype = torch.float32 if names.is_fp32_param(name) else dtype
            t = read(e.stored)
            if e.scale is not None:
                try:
                    t = dequantize(t, read(e.scale), block, out_dtype)
                except QuantFormatError as exc:
                    raise CheckpointError(f"tensor {e.stored.key!r} in {model_dir}: {exc}") from None
            if t.is_floating_point():
                t = t.to(out_dtype)
            elif name.endswith(".tid2eid"):
                t = t.to(torch.int64)
            if _is_slice(e.target):
                merged = tensors.get(name)
                if merged is None:
                    merged = tensors[name] = torch.empty(expected[name], dtype=out_dtype, device=device)
                rows = expected[name][1] // 2
                if e.target.part == "gate":
                    merged[e.target.expert, :rows] = t
                elif e.target.part == "up":
                    merged[e.target.expert, rows:] = t
                else:
                    merged[e.target.expert] = t
            else:
                tensors[name] = t.contiguous()
            bar.update(1)
    return tensors
