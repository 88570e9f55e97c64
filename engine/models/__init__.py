"""Model definitions, looked up by ``model_type`` in the registry (registry.py)."""

from __future__ import annotations


def build_model(config, **kwargs):
    """An uninitialised model module for ``config`` (weights come from ``load_state_dict``)."""
    from deepinfer.engine.models.registry import family

    return family(config.model_type).build_model(config, **kwargs)
