"""`deepinfer node`: the long-lived daemons of a cluster, from its cluster file.

    deepinfer node --cluster cluster.toml --host NAME      every node of host NAME, in this process
    deepinfer node --cluster cluster.toml --role R [--name N]   one node (N: the only R node if left out)
    deepinfer node --cluster cluster.toml --role decode|prefill --ep N   its engine expert-parallel
                   over N rank processes (rank 0 in this process: runtime/ep/node_group.py)

SIGTERM/SIGINT drain every node of the process gracefully; a second signal stops them at once.
"""

from __future__ import annotations

import logging

from deepinfer import envs
from deepinfer.bin.cli import CliError, NotBuiltError
from deepinfer.bin.serve import NODE_SWA_FLAGS, add_spec_arguments, add_swa_arguments, check_spec_with_ep
from deepinfer.runtime.disagg.cli_args import add_detector_arguments, detector_overrides

# DetectorSettings field -> NodeSettings field
_NODE_DETECTOR_FIELDS = {"interval_s": "heartbeat_interval_s", "suspect_phi": "suspect_phi",
                         "min_silence_s": "min_silence_s", "max_silence_s": "max_silence_s",
                         "probe_timeout_s": "probe_timeout_s"}
_ROLES = ["gateway", "encoder", "prefill", "decode", "storage"]


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name,
        help="run the node daemons of a cluster host, or one node in a role",
        description="Run node daemons (gateway, encoder, prefill, decode, storage) from a cluster config: "
                    "with --host every node the file places on that host, with --role one node. "
                    "SIGTERM/SIGINT drain them gracefully; a second signal stops them at once.",
    )
    p.add_argument("--cluster", required=True, help="cluster config TOML file")
    p.add_argument("--host", default=None, help="run every node the config places on this host (its nodes' "
                                                "host key, or their names)")
    p.add_argument("--role", default=None, choices=_ROLES, help="run one node in this role (without --host)")
    p.add_argument("--name", default=None, help="with --role: this node's name in the cluster config "
                                                "(default: the only node with --role)")
    e = p.add_argument_group("prefill/decode engines and gateways (override the config's [engine] section)")
    e.add_argument("--model", default=None, help="HF-style model directory (default: [engine] model, "
                                                 "else DEEPINFER_HF_MODEL_DIR)")
    e.add_argument("--max-num-seqs", type=int, default=None, help="sequences decoded together (default 8)")
    e.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks")
    e.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens (default: the model's)")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 128)")
    e.add_argument("--dtype", default=None, help="compute dtype (default auto: float32 on CPU)")
    e.add_argument("--quantization", default=None, choices=("fp8",),
                   help="fp8: serve the checkpoint's FP8/FP4 GEMM weights as block-scaled FP8 (serve --help)")
    e.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    e.add_argument("--lease-s", type=float, default=5.0,
                   help="prefill: seconds exported KV is held without an ack or renewal (default 5)")
    e.add_argument("--kv-store-nodes", default=None, metavar="ADDRS|FILE",
                   help="the engines' KV store: storage node addresses, a membership file or a cluster file "
                        "(default: the storage nodes of --cluster, unless [engine] kv_store = false)")
    e.add_argument("--kv-store-ec", default=None, metavar="K+M", help="erasure coding of a --kv-store-nodes list")
    e.add_argument("--kv-load-deadline", dest="kv_load_deadline_s", type=float, default=None, metavar="S",
                   help="seconds a prefix read from the store may take before the engine computes the rest")
    e.add_argument("--kv-host-tier-bytes", type=int, default=None, metavar="BYTES", help="host memory KV tier")
    e.add_argument("--served-model-name", default=None, help="gateway: the model name clients ask for "
                                                             "(default: the model directory's name)")
    e.add_argument("--ep", type=int, default=1, metavar="N",
                   help="prefill/decode with --role: the engine's MoE layers expert-parallel over N rank "
                        "processes (this one is rank 0 and takes the node's requests; default 1)")
    e.add_argument("--ep-redundant-experts", type=int, default=0, metavar="R",
                   help="with --ep: replica slots per rank beyond the experts it owns, for EPLB (default 0)")
    add_swa_arguments(p, is_node=True)  # swa-wire: SWA slot flags of prefill/decode engines
    # DSpark on decode engines (a prefill engine hands off after the first token)
    add_spec_arguments(p, "speculative decoding (DSpark; decode engines only: with --host, its decode nodes)")
    add_detector_arguments(p)  # override the cluster config's [cluster] failure-detection keys
    return p


# the spec flags reach prefill engines too with --host; node_role.make_role turns speculation off there
_ENGINE_FLAGS = ("max_num_seqs", "num_blocks", "max_model_len", "block_size", "dtype", "quantization", "num_threads",
                 "kv_store_nodes", "kv_store_ec", "kv_load_deadline_s", "kv_host_tier_bytes", *NODE_SWA_FLAGS,
                 "speculative", "num_draft_tokens", "spec_schedule")


def _role_kwargs(args, role) -> dict:
    """Extra make_role arguments: model and engine knobs of engines and gateways."""
    options = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k, None) is not None}
    if role.value == "gateway":
        if args.served_model_name:
            options["served_model_name"] = args.served_model_name
        return {"model": args.model, "engine_options": options}
    if role.value == "encoder":  # the vision tower only: the model, its dtype and threads
        return {"model": args.model, "engine_options": {k: options[k] for k in ("dtype", "num_threads") if k in options}}
    if role.value not in ("prefill", "decode"):
        return {}
    kwargs = {"model": args.model, "engine_options": options, "lease_s": args.lease_s}
    if args.ep > 1:
        kwargs.update(ep_size=args.ep, ep_settings={"redundant_per_rank": args.ep_redundant_experts})
    return kwargs


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

    from deepinfer.runtime import loop
    from deepinfer.runtime.cluster_config import ClusterConfigError, NodeRole, load_cluster_config
    from deepinfer.runtime.host_nodes import HostNodes

    if (args.host is None) == (args.role is None):
        raise CliError("give --host NAME (every node of a host) or --role ROLE (one node)", code=2)
    if args.host is not None and args.name is not None:
        raise CliError("--name goes with --role; --host runs every node of the host", code=2)
    if args.ep < 1 or args.ep_redundant_experts < 0:
        raise CliError(f"--ep must be >= 1 and --ep-redundant-experts >= 0, got {args.ep} and "
                       f"{args.ep_redundant_experts}", code=2)
    if args.ep > 1 and (args.role not in ("prefill", "decode")):
        raise CliError("--ep N goes with --role prefill or --role decode (one EP group per process)", code=2)
    if args.role is not None and args.role != "decode" and (args.speculative or "off") != "off":
        raise CliError("--speculative goes with --role decode: the decode engine drafts (a prefill engine hands "
                       "off after the first token)", code=2)
    check_spec_with_ep(args)
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        raise CliError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}", code=2)
    if args.role is not None:
        from deepinfer.runtime.roles import RoleNotBuilt, role_factory

        try:  # before the config: an unbuilt role says so whatever the file
            role_factory(NodeRole(args.role))
        except RoleNotBuilt as exc:
            raise NotBuiltError(str(exc)) from None
    try:
        config = load_cluster_config(args.cluster)
    except ClusterConfigError as exc:
        raise CliError(str(exc)) from None
    if args.host is not None:
        try:
            names = [spec.name for spec in config.nodes_on_host(args.host)]
        except KeyError as exc:
            raise CliError(exc.args[0]) from None
    else:
        role = NodeRole(args.role)
        name = args.name or _only_node_with_role(config, role)
        try:
            spec = config.node(name)
        except KeyError as exc:
            raise CliError(exc.args[0]) from None
        if spec.role != role:
            raise CliError(f"node {name!r} has role {spec.role.value} in {args.cluster}, not {role.value}")
        names = [name]
    nodes = [_node_plan(config, n, args) for n in names]
    logging.basicConfig(level=envs.get().log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def serve() -> None:
        host = HostNodes()
        for name, settings, make_role, role in nodes:
            try:
                role_object = make_role(role=role, config=config, node_name=name, **_role_kwargs(args, role))
            except (ValueError, FileNotFoundError) as exc:  # the role's own config checks
                raise CliError(f"{args.cluster}: {exc}") from None
            host.add(settings, role_object)
        host.install_signal_handlers()
        if parent is not None:  # the parent died: stop now, nobody is left to drain for
            parent.watch(asyncio.get_running_loop(), lambda: asyncio.ensure_future(host.stop_when_started()))
        await host.start()
        await host.wait_stopped()

    loop.run(serve())
    return 0


def _node_plan(config, name: str, args):
    """(name, NodeSettings, make_role, role) of one node, every mistake a CliError."""
    from dataclasses import replace

    from deepinfer.runtime.node import NodeSettings
    from deepinfer.runtime.roles import RoleNotBuilt, role_factory

    role = config.node(name).role
    try:
        make_role = role_factory(role)
    except RoleNotBuilt as exc:
        raise NotBuiltError(str(exc)) from None
    try:
        settings = NodeSettings.from_cluster(config, name)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        raise CliError(exc.args[0] if isinstance(exc, KeyError) else str(exc)) from None
    overrides = detector_overrides(args)
    settings = replace(settings, **{_NODE_DETECTOR_FIELDS[k]: v for k, v in overrides.items()})
    try:
        settings.detector  # noqa: B018 -- flags contradicting each other (or the config) fail here
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    return name, settings, make_role, role


def _only_node_with_role(config, role) -> str:
    names = [spec.name for spec in config.nodes_with_role(role)]
    if len(names) != 1:
        listed = ", ".join(names) or "none"
        raise CliError(f"--name is required: the config has {len(names)} {role.value} nodes ({listed})")
    return names[0]
