"""``make_role`` for ``deepinfer node --role encoder`` (registered in runtime/roles.py).

The node's spec names its encode RPC address in ``engine`` (``engine = "tcp://HOST:PORT"``, the
ROUTER the gateways send images to). The model comes from ``--model``, the cluster file's
``[engine] model`` or DEEPINFER_HF_MODEL_DIR; ``[engine] dtype`` and ``num_threads`` apply. Only
the vision tower is loaded (its tensors read from the checkpoint), never the text model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepinfer import envs
from deepinfer.runtime.cluster_config import ClusterConfig, NodeRole
from deepinfer.runtime.encoder.service import EncoderService


def make_role(*, role: NodeRole, config: ClusterConfig, node_name: str, model: str | None = None,
              engine_options: Mapping[str, Any] | None = None, device: str = "auto") -> EncoderService:
    import torch

    from deepinfer.engine.core.factory import resolve_device
    from deepinfer.engine.loader.weights import resolve_dtype
    from deepinfer.engine.mm.encoder import VisionEncoder
    from deepinfer.engine.models.registry import read_model_config

    if role is not NodeRole.ENCODER:
        raise ValueError(f"node {node_name}: the encoder service runs the encoder role, not {role.value}")
    spec = config.node(node_name)
    if not spec.engine:
        raise ValueError(f"nodes.{node_name}.engine: an encoder node needs an encode RPC address "
                         "(tcp://HOST:PORT or ipc://PATH)")
    model_dir = model or config.engine.model or envs.get().hf_model_dir
    if not model_dir:
        raise ValueError("no model: pass --model DIR, set [engine] model in the cluster file or DEEPINFER_HF_MODEL_DIR")
    options = {**config.engine.options(), **dict(engine_options or {})}
    if options.get("num_threads"):
        torch.set_num_threads(int(options["num_threads"]))
    cfg = read_model_config(model_dir)
    where = resolve_device(device)
    dtype = options.get("dtype") or "auto"
    compute = resolve_dtype("float32" if dtype == "auto" and where == "cpu" else dtype, cfg)
    vision = VisionEncoder.load(model_dir, cfg, dtype=compute, device=where)
    if vision is None:
        raise ValueError(f"{model_dir}: this model has no vision tower (config.json has no vision_config)")
    return EncoderService(vision, spec.engine)
