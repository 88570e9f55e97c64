"""``make_role`` for ``deepinfer node --role prefill|decode`` (registered in runtime/roles.py).

The node's spec must name an engine RPC address (``engine = ...``); a decode node also its
bulk data address (``data = ...``). The model comes from ``--model``, the cluster file's
``[engine] model`` or DEEPINFER_HF_MODEL_DIR; engine knobs from ``[engine]`` and then
``engine_options`` (``deepinfer node --max-num-seqs ...``). Engines use the file's storage nodes
as their KV store (prefill: prefix reads + write-behind; decode: write-behind of the blocks it
generates) unless ``[engine] kv_store = false`` or the flags name another store; a prefill node with
``--swa-directory`` shares its SWA slots through it, a decode node keeps none). Prefill and
decode engines of one cluster must load the same model with the same KV layout (checked on
every import). With ``ep_size`` > 1 the engine is rank 0 of an expert-parallel group whose other
ranks are child processes (runtime/ep/node_group.py); the role ends the node when the group breaks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from deepinfer import envs
from deepinfer.runtime.cluster_config import ClusterConfig, NodeRole
from deepinfer.runtime.disagg.engine_service import DisaggEngineService, EngineServiceConfig
from deepinfer.runtime.kv_store_cluster import engine_store_of


def model_dir_of(config: ClusterConfig, model: str | None) -> str:
    """--model, else the cluster file's [engine] model, else DEEPINFER_HF_MODEL_DIR."""
    model_dir = model or config.engine.model or envs.get().hf_model_dir
    if not model_dir:
        raise ValueError("no model: pass --model DIR, set [engine] model in the cluster file or DEEPINFER_HF_MODEL_DIR")
    return model_dir


def make_role(*, role: NodeRole, config: ClusterConfig, node_name: str, model: str | None = None,
              engine_options: Mapping[str, Any] | None = None, lease_s: float = 5.0, ep_size: int = 1,
              ep_settings: Mapping[str, Any] | None = None):
    from deepinfer.engine.core.factory import build_engine
    from deepinfer.engine.core.options import EngineOptions
    from deepinfer.runtime.disagg.decode import DecodeService
    from deepinfer.runtime.disagg.prefill import PrefillService

    spec = config.node(node_name)
    if role not in (NodeRole.PREFILL, NodeRole.DECODE):
        raise ValueError(f"node {node_name}: the disaggregated engine serves prefill or decode, not {role.value}")
    if not spec.engine:
        raise ValueError(f"nodes.{node_name}.engine: a {role.value} node needs an engine RPC address (tcp://HOST:PORT or ipc://PATH)")
    if role is NodeRole.DECODE and not spec.data:
        raise ValueError(f"nodes.{node_name}.data: a decode node needs a data address to receive KV")
    model_dir = model_dir_of(config, model)
    # [engine] of the cluster file, then the node's flags; the storage nodes of the file unless
    # the flags name a store of their own
    given = {**config.engine.options(), **dict(engine_options or {})}
    if "kv_store_nodes" not in given and not given.get("kv_store_dir"):
        given.update(engine_store_of(config))
    options = EngineOptions.from_kwargs(**given)
    if role is NodeRole.DECODE:
        # a decode engine continues handed-off requests (their SWA state comes with the KV): no
        # slot store of its own; the prefill engines own and share the slots
        options = replace(options, swa_store_slots=0, swa_directory=None)
    else:
        # a prefill engine stops right after the prompt: without ending the prompt's last chunk
        # at a block boundary, hardly any prompt would leave a slot for its next turn; it decodes
        # nothing, so it never drafts (the decode engine does: DSpark's context ring fills from
        # the positions it computes, the prompt's are absent)
        options = replace(options, swa_snapshot_prompts=True, speculative="off")
    # images are encoded on encoder nodes; the embeddings come in with the dispatch (prefill) or the KV (decode)
    options = replace(options, load_vision=False)
    group = None
    if ep_size > 1:
        from deepinfer.engine.parallel.settings import EpSettings
        from deepinfer.runtime.ep.node_group import EpNodeGroup

        group = EpNodeGroup(model_dir, ep_size, given, EpSettings(**dict(ep_settings or {})))
        options = replace(options, expert_parallel=group.start())
    try:
        parts = build_engine(model_dir, options)
    except BaseException as exc:
        if group is None:
            raise
        lost = group.lost()  # a rank that could not start: the reason rank 0 could not form the group
        group.stop(grace_s=1.0)
        if lost is not None and not isinstance(exc, ValueError):
            raise ValueError(f"the EP group could not form: {lost}") from exc
        raise
    service_config = EngineServiceConfig(engine_address=spec.engine, data_address=spec.data, lease_s=lease_s,
                                         swa_directory=options.swa_directory or "",
                                         swa_peer_host=options.swa_peer_host)
    cls = PrefillService if role is NodeRole.PREFILL else DecodeService
    if group is None:
        return cls(parts, service_config)
    from deepinfer.runtime.ep.node_group import EpNodeRole

    return EpNodeRole(cls(parts, service_config), group)
