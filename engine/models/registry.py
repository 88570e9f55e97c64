"""Model families by ``model_type``: what the generic engine asks of a model (ARCHITECTURE.md, "Model registry").

The runner, the factory and the checkpoint loader never import a model package; they look its
family up here. A family is a module exporting ``FAMILY: ModelFamily``, listed once in
``FAMILY_MODULES`` below (imported on first use, so ``import deepinfer.engine`` pulls in no model):

    FAMILY_MODULES = {"deepseek_v4": "deepinfer.engine.models.deepseek_v4.family", ...}

What a family supplies:

- ``config_class.from_dict(raw)``: the typed config of a parsed config.json (raising
  ``ModelConfigError`` naming the field). The generic engine reads only the fields of
  ``FamilyConfig`` from it;
- ``load_checkpoint(model_dir, *, dtype, device, progress) -> (config, canonical tensors)``, e.g.
  engine/loader/weights.py's safetensors loader with the family's ``checkpoint_names()`` module
  (stored name -> canonical name, expected shapes, float32 parameters, MTP tensors);
- ``build_model(config, *, device, dtype)``: an uninitialised module with ``geometry(block_size,
  lookahead)``, ``paged_specs()``, ``ring_specs(lookahead)``, ``finalize()``, ``compute_logits(hidden,
  batch_invariant)`` and ``forward(context, blocks, swa) -> hidden``;
- ``forward_context() -> (validate, build_context)``: ``validate(batch, geometry, num_slots)``
  raises for a batch the model cannot run, ``build_context(batch, geometry, device=, batch_invariant=)``
  turns a ``ForwardBatch`` into the model's per-forward index plans;
- ``accepts_untyped(raw)``: whether a config.json without ``model_type`` is this family's;
- for a family that reads images: ``image_processor(config)`` (the preprocessing, from the config
  alone, None when the checkpoint has no vision tower) and ``load_vision_tower(model_dir, config,
  *, dtype, device)`` (the tower's weights); engine/mm/encoder.py wraps the two;
- for a family that drafts: ``build_drafter(model, *, model_dir)``, a ``DraftModel``
  (engine/spec/draft_model.py) over the built target (DSpark, ``--speculative dspark``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from deepinfer.engine.loader.config_fields import ModelConfigError, read_config_json

# model_type -> the module whose FAMILY describes it
FAMILY_MODULES = {
    "deepseek_v4": "deepinfer.engine.models.deepseek_v4.family",
    "deepseek_v41": "deepinfer.engine.models.deepseek_v41.family",
}


class FamilyConfig(Protocol):
    """The fields of a family's config that the generic engine reads."""

    model_type: str
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int  # tokens of the per-sequence window state (SWA slots, replay bounds)
    num_hidden_layers: int
    eos_token_id: tuple[int, ...]
    tie_word_embeddings: bool
    checkpoint_dtype: str | None


@dataclass(frozen=True, slots=True)
class ModelFamily:
    model_type: str
    architecture: str  # config.json "architectures" entry
    config_class: Any  # .from_dict(raw) -> FamilyConfig
    load_checkpoint: Callable[..., tuple[Any, dict]]
    build_model: Callable[..., Any]
    forward_context: Callable[[], tuple[Callable, Callable]]
    accepts_untyped: Callable[[Mapping[str, Any]], bool] = lambda raw: False
    # the tensor naming loader/weights.py reads checkpoints with (None: the family loads its own way)
    checkpoint_names: Callable[[], Any] | None = None
    # images (engine/mm/): None for a text-only family
    image_processor: Callable[[Any], Any] | None = None
    load_vision_tower: Callable[..., Any] | None = None
    # speculative decoding (engine/spec/): None for a family without a drafter
    build_drafter: Callable[..., Any] | None = None


_families: dict[str, ModelFamily] = {}


def family(model_type: str) -> ModelFamily:
    """The family of ``model_type``; ``ModelConfigError`` naming the supported ones otherwise."""
    found = _families.get(model_type)
    if found is None:
        module = FAMILY_MODULES.get(model_type)
        if module is None:
            raise ModelConfigError(f"unsupported model_type {model_type!r} in config; "
                                   f"supported: {', '.join(FAMILY_MODULES)}")
        found = _families[model_type] = importlib.import_module(module).FAMILY
    return found


def family_of_config(raw: Mapping[str, Any]) -> ModelFamily:
    """The family a parsed config.json belongs to (by ``model_type``, else the family that claims it)."""
    model_type = raw.get("model_type")
    if model_type is not None:
        return family(model_type)
    for name in FAMILY_MODULES:
        candidate = family(name)
        if candidate.accepts_untyped(raw):
            return candidate
    raise ModelConfigError(f"unsupported no model_type in config; supported: {', '.join(FAMILY_MODULES)}")


def read_model_config(model_dir: str | Path):
    """The typed config of ``model_dir/config.json``, parsed by its family."""
    raw = read_config_json(model_dir)
    return family_of_config(raw).config_class.from_dict(raw)
