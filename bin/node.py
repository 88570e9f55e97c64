"""`deepinfer node`: one long-lived daemon of a cluster, in one role."""

from __future__ import annotations

import logging

from deepinfer import envs
from deepinfer.bin.cli import CliError, NotBuiltError
from deepinfer.bin.serve import NODE_SWA_FLAGS, add_swa_arguments
from deepinfer.runtime.disagg.cli_args import add_detector_arguments, detector_overrides

# DetectorSettings field -> NodeSettings field
_NODE_DETECTOR_FIELDS = {"interval_s": "heartbeat_interval_s", "suspect_phi": "suspect_phi",
                         "min_silence_s": "min_silence_s", "max_silence_s": "max_silence_s",
                         "probe_timeout_s": "probe_timeout_s"}


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name,
        help="run one cluster node daemon in a role",
        description="Run one node daemon (gateway, encoder, prefill, decode or storage) from a cluster config. "
                    "SIGTERM/SIGINT drain it gracefully; a second signal stops it at once.",
    )
    p.add_argument("--role", required=True, choices=["gateway", "encoder", "prefill", "decode", "storage"])
    p.add_argument("--cluster", required=True, help="cluster config TOML file")
    p.add_argument("--name", default=None, help="this node's name in the cluster config "
                                                "(default: the only node with --role)")
    e = p.add_argument_group("prefill/decode engines")
    e.add_argument("--model", default=None, help="HF-style model directory (default: DEEPINFER_HF_MODEL_DIR)")
    e.add_argument("--max-num-seqs", type=int, default=None, help="sequences decoded together (default 8)")
    e.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks")
    e.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens (default: the model's)")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 128)")
    e.add_argument("--dtype", default=None, help="compute dtype (default auto: float32 on CPU)")
    e.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    e.add_argument("--lease-s", type=float, default=5.0,
                   help="prefill: seconds exported KV is held without an ack or renewal (default 5)")
    add_swa_arguments(p, is_node=True)  # swa-wire: SWA slot flags of prefill/decode engines
    add_detector_arguments(p)  # override the cluster config's [cluster] failure-detection keys
    return p


_ENGINE_FLAGS = ("max_num_seqs", "num_blocks", "max_model_len", "block_size", "dtype", "num_threads", *NODE_SWA_FLAGS)


def _role_kwargs(args, role) -> dict:
    """Extra make_role arguments of the engine roles (prefill/decode): model and engine knobs."""
    if role.value not in ("prefill", "decode"):
        return {}
    options = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k, None) is not None}
    return {"model": args.model, "engine_options": options, "lease_s": args.lease_s}


def run(args) -> int:
    from deepinfer.runtime.lifeline import ParentDied, ParentWatch

    # started by a supervisor (serve --disaggregated): end with it, even while still loading
    parent = ParentWatch.from_env()
    try:
        if parent is not None:
            parent.arm()
        return _run(args, parent)
    except ParentDied:
        return 0
    finally:
        if parent is not None and parent.has_parent_died:
            parent.cleanup()


def _run(args, parent) -> int:
    import asyncio
    from dataclasses import replace

    from deepinfer.runtime import loop
    from deepinfer.runtime.cluster_config import ClusterConfigError, NodeRole, load_cluster_config
    from deepinfer.runtime.node import Node, NodeSettings
    from deepinfer.runtime.roles import RoleNotBuilt, role_factory

    role = NodeRole(args.role)
    try:
        make_role = role_factory(role)
    except RoleNotBuilt as exc:
        raise NotBuiltError(str(exc)) from None
    try:
        config = load_cluster_config(args.cluster)
    except ClusterConfigError as exc:
        raise CliError(str(exc)) from None
    name = args.name or _only_node_with_role(config, role)
    try:
        spec = config.node(name)
        if spec.role != role:
            raise CliError(f"node {name!r} has role {spec.role.value} in {args.cluster}, not {role.value}")
        settings = NodeSettings.from_cluster(config, name)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        raise CliError(exc.args[0] if isinstance(exc, KeyError) else str(exc)) from None
    overrides = detector_overrides(args)
    settings = replace(settings, **{_NODE_DETECTOR_FIELDS[k]: v for k, v in overrides.items()})
    try:
        settings.detector  # noqa: B018 -- flags contradicting each other (or the config) fail here
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    logging.basicConfig(level=envs.get().log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def serve() -> None:
        try:
            role_object = make_role(role=role, config=config, node_name=name, **_role_kwargs(args, role))
        except (ValueError, FileNotFoundError) as exc:  # the role's own config checks
            raise CliError(f"{args.cluster}: {exc}") from None
        node = Node(settings, [role_object])
        node.install_signal_handlers()
        if parent is not None:  # the parent died: stop now, nobody is left to drain for
            parent.watch(asyncio.get_running_loop(), lambda: asyncio.ensure_future(node.stop_when_started()))
        await node.start()
        await node.wait_stopped()

    loop.run(serve())
    return 0


def _only_node_with_role(config, role) -> str:
    names = [spec.name for spec in config.nodes_with_role(role)]
    if len(names) != 1:
        listed = ", ".join(names) or "none"
        raise CliError(f"--name is required: the config has {len(names)} {role.value} nodes ({listed})")
    return names[0]
