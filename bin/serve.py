"""`deepinfer serve`: the OpenAI-compatible server, gateway and engine in this one process.

With no ``--model`` it serves the built-in tiny model (runtime/gateway/builtin_model.py): the
trained tiny DeepSeek-V4.1 checkpoint shipped in the package, or with
DEEPINFER_BUILTIN_MODEL=random the random tiny V4 model written once into the user cache dir.
SIGINT/SIGTERM shut down cleanly (exit status 0).
"""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import fields
from pathlib import Path

from deepinfer import envs
from deepinfer.bin.cli import CliError

BUILTIN_MODEL_NAME = "deepinfer-tiny"
DTYPES = ("auto", "float32", "bfloat16", "float16")

# CLI flag dest -> EngineOptions field; only flags the user gave are passed (the engine's defaults apply)
ENGINE_FLAGS = ("dtype", "device", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks",
                "block_size", "max_num_waiting", "seed", "num_threads", "swa_replay", "swa_replay_tokens",
                "swa_store_slots", "swa_snapshot_prompts", "swa_fetch_deadline_s", "swa_directory", "swa_node_name",
                "swa_peer_host", "kv_host_tier_bytes", "kv_store_dir", "kv_store_nodes", "kv_store_ec",
                "kv_load_deadline_s", "speculative", "num_draft_tokens", "spec_schedule", "quantization")


def add_parser(subparsers, name):
    p = subparsers.add_parser(
        name,
        help="run the OpenAI-compatible server",
        description="Run the OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, "
                    "/health, /metrics) with the engine in this process. With no --model it serves the built-in "
                    "tiny model, created once under DEEPINFER_CACHE_DIR. SIGINT/SIGTERM shut it down cleanly.",
    )
    # argparse prints usage + error over two lines, and leaves unknown options to the top-level
    # parser; every bad option of serve gets one line naming it and exit status 2 instead
    p.error = lambda message: _one_line_usage_error(name, message)
    parse_known = p.parse_known_args

    def parse_all_known(args=None, namespace=None):
        namespace, extras = parse_known(args, namespace)
        if extras:
            p.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    p.parse_known_args = parse_all_known
    p.add_argument("--model", default=None,
                   help="HF-style model directory (default: DEEPINFER_HF_MODEL_DIR, else the built-in tiny model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) requests may use (default: the model directory's name)")
    p.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="generation requests served at once before HTTP 429 (default: no gateway limit)")
    p.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds requests in flight may take to finish before they are "
                        "aborted (default 5)")
    add_http_arguments(p)
    add_image_arguments(p)
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", default=None, choices=DTYPES, help="compute dtype (default auto: float32 on CPU)")
    e.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default auto)")
    e.add_argument("--quantization", default=None, choices=("fp8",),
                   help="fp8: serve the GEMM weights the checkpoint stores in FP8/FP4 (attention projections, "
                        "experts) as block-scaled FP8, half the bytes of bfloat16 (fast FP8 GEMMs on NVIDIA "
                        "GPUs; elsewhere a slow reference). Default: dequantised to --dtype")
    e.add_argument("--max-num-seqs", type=int, default=None, help="sequences decoded together (default 8)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    e.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens (default: the model's)")
    e.add_argument("--num-blocks", type=int, default=None,
                   help="KV-cache blocks (default: max-num-seqs full contexts)")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 128)")
    e.add_argument("--max-num-waiting", type=int, default=None,
                   help="queued requests before HTTP 429 (default: no limit)")
    e.add_argument("--seed", type=int, default=None, help="seed source for requests that give none")
    e.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.add_argument("--ep", type=int, default=1, metavar="N",
                   help="expert parallel over N rank processes (attention data-parallel: each request runs on "
                        "one rank; the MoE layers' experts are spread over all of them and re-placed by EPLB). "
                        "A rank that dies fails the requests in flight and the group restarts. With "
                        "--disaggregated every prefill and decode engine is such a group (default 1)")
    e.add_argument("--ep-redundant-experts", type=int, default=0, metavar="R",
                   help="with --ep: replica slots per rank beyond the experts it owns, for EPLB (default 0)")
    add_spec_arguments(p)
    add_swa_arguments(p)
    from deepinfer.runtime.disagg.cli_args import add_disagg_arguments  # pd-disagg hook: --disaggregated ...

    add_disagg_arguments(p)
    return p


def add_spec_arguments(p, title: str = "speculative decoding (DSpark)") -> None:
    """DSpark speculative decoding (EngineOptions.speculative, num_draft_tokens, spec_schedule)."""
    d = p.add_argument_group(title)
    d.add_argument("--speculative", default=None, choices=("off", "dspark"),
                   help="dspark: draft with the checkpoint's DSpark stages and verify exactly (outputs unchanged); "
                        "off (default)")
    d.add_argument("--num-draft-tokens", type=int, default=None, metavar="N",
                   help="drafts a request may verify per step (default 5; at most the drafter's block)")
    d.add_argument("--spec-schedule", default=None, choices=("confidence", "throughput", "fixed"),
                   help="which drafts are verified: confidence (default) picks each request's length across the "
                        "batch from the drafter's confidences and the step times fitted at start-up, keeping at "
                        "least 95%% of the expected tokens of verifying all; throughput drops that floor and skips "
                        "drafting while it does not pay (best tokens/s where verify tokens are dear, e.g. a CPU "
                        "with many sequences); fixed verifies all of them")


def check_spec_with_ep(args) -> None:
    """--speculative dspark with --ep > 1 (serve and node): refused before anything starts."""
    if args.ep > 1 and (args.speculative or "off") != "off":
        raise CliError("--speculative dspark does not run with --ep > 1 yet; leave one of them out", code=2)


# the SWA flags a `deepinfer node` prefill/decode engine takes too (bin/node.py)
NODE_SWA_FLAGS = ("swa_replay", "swa_replay_tokens", "swa_store_slots", "swa_snapshot_prompts",
                  "swa_fetch_deadline_s", "swa_directory", "swa_peer_host")


def add_swa_arguments(p, *, is_node: bool = False) -> None:
    """SWA slot and KV tier flags (their EngineOptions fields keep the defaults when not given);
    ``is_node``: only ``NODE_SWA_FLAGS`` (a cluster node's name and directory come from its config)."""
    env = envs.names()
    s = p.add_argument_group("SWA slots (sliding-window state of prefix hits)")
    s.add_argument("--swa-replay", default=None, choices=("exact", "bounded"),
                   help="rebuild of a prefix hit's window state when no slot holds it: exact (default) replays "
                        "window x layers tokens and equals a full prefill; bounded replays only the last "
                        "--swa-replay-tokens (constant cost, approximate, kept out of the prefix cache)")
    s.add_argument("--swa-replay-tokens", type=int, default=None, metavar="N",
                   help="tokens a bounded replay recomputes (default 128)")
    s.add_argument("--swa-store-slots", type=int, default=None, metavar="N",
                   help="host slots saving finished/preempted sequences' window state, so a continued "
                        "conversation restores it without replay (default 0: none, every rebuild exact). One "
                        "slot is layers x (window + lookahead) rows x (head_dim x 33/32) bytes (MXFP8) plus "
                        "compressor carry rows: ~1.4 MB for V4-Flash's 20 persisted layers. MXFP8 window rows make "
                        "a restored state approximate; 0 keeps every rebuild exact")
    s.add_argument("--swa-snapshot-prompts", action="store_true", default=None,
                   help="end each prompt's last chunk at its last block boundary so its slot is saved even when "
                        "the reply never crosses one (one more step for the prompt's tail)")
    s.add_argument("--swa-fetch-deadline", dest="swa_fetch_deadline_s", type=float, default=None, metavar="S",
                   help="seconds a slot fetch from another engine may take before the request replays (default 0.1)")
    s.add_argument("--swa-directory", default=None, metavar="ADDR",
                   help="SWA slot directory (tcp://HOST:PORT): share slots with the other engines using it")
    s.add_argument("--swa-peer-host", default=None, metavar="HOST",
                   help="interface other engines fetch this engine's slots on (default 127.0.0.1)")
    if is_node:
        return
    s.add_argument("--swa-directory-bind", default=None, metavar="ADDR",
                   help="host the SWA slot directory in this process at ADDR (tcp://HOST:PORT; PORT * picks one) "
                        "and use it; other engines join with --swa-directory")
    s.add_argument("--swa-node-name", default=None, metavar="NAME",
                   help="this engine's name in the SWA directory (default: HOST-PID)")
    k = p.add_argument_group("KV tiers (prefix blocks beyond the device pool)")
    k.add_argument("--kv-host-tier-bytes", type=int, default=None, metavar="BYTES",
                   help=f"host-memory KV tier size (default ${env['kv_host_tier_bytes']}, else 0: none)")
    k.add_argument("--kv-store-dir", default=None, metavar="DIR",
                   help="filesystem KV store shared by the engines of this host (default: none)")
    k.add_argument("--kv-store-nodes", default=None, metavar="ADDRS|FILE",
                   help="erasure-coded storage cluster (`deepinfer storage` daemons) for KV blocks: comma-separated "
                        "node addresses tcp://HOST:PORT (NAME=tcp://... to use the nodes' names; engines sharing a "
                        "cluster must list the same nodes, as objects are placed by name), or a cluster config file "
                        "whose role = \"storage\" nodes and [storage] ec_k/ec_m are used. A dead or slow cluster "
                        "only costs recomputation. Not with --kv-store-dir "
                        f"(default ${env['kv_store_nodes']}, else none)")
    k.add_argument("--kv-store-ec", default=None, metavar="K+M",
                   help="erasure coding of a --kv-store-nodes address list: K data + M parity fragments per block, "
                        "K+M <= the node count; every engine sharing the cluster must use the same "
                        f"(default ${env['kv_store_ec']}, else 10+2)")
    k.add_argument("--kv-load-deadline", dest="kv_load_deadline_s", type=float, default=None, metavar="S",
                   help=f"seconds a prefix-block read from the KV store may take before recomputing "
                        f"(default ${env['kv_load_deadline_s']}, else 0.25)")


# --- HTTP connection limits (GatewayConfig fields; runtime/gateway/connections.py) ---------------

# flag dest -> (GatewayConfig field, its default: shown in --help without importing the gateway;
# tests/runtime/test_gateway_hostile.py checks they match)
HTTP_FLAGS = {"header_timeout": ("header_timeout_s", 30.0), "body_timeout": ("body_timeout_s", 60.0),
              "keepalive_timeout": ("keepalive_timeout_s", 75.0), "max_connections": ("max_connections", 1000)}


def add_http_arguments(p) -> None:
    """Deadlines and the connection cap that keep slow or silent clients from holding the server."""
    default = {dest: value for dest, (_, value) in HTTP_FLAGS.items()}
    h = p.add_argument_group("HTTP connections (slow, silent or too many clients)")
    h.add_argument("--header-timeout", type=float, default=None, metavar="S",
                   help="seconds a connection may take, from being accepted (or from the first byte of a later "
                        "request on it), to send complete request headers; then it is closed, with HTTP 408 if "
                        f"it sent anything (default {default['header_timeout']:g})")
    h.add_argument("--body-timeout", type=float, default=None, metavar="S",
                   help="seconds a request's whole body may take to arrive once its headers have; then HTTP 408 "
                        f"and closed (default {default['body_timeout']:g})")
    h.add_argument("--keepalive-timeout", type=float, default=None, metavar="S",
                   help="seconds an idle keep-alive connection stays open between requests "
                        f"(default {default['keepalive_timeout']:g})")
    h.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="HTTP connections open at once; a new one beyond gets HTTP 503 and is closed at once, "
                        "while the open ones keep working. Lowered to fit the open-file limit (ulimit -n) "
                        f"(default {default['max_connections']})")


def add_image_arguments(p) -> None:
    """Chat image_url parts (runtime/gateway/chat_images.py; a model with a vision tower)."""
    i = p.add_argument_group("images in chat messages")
    i.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image_url parts (default: only data: URLs; a URL is a 400)")
    i.add_argument("--max-image-bytes", type=int, default=None, metavar="N",
                   help="largest encoded image per content part; a bigger one is a 400 (default 2 MiB)")


def image_settings(args) -> dict:
    out = {"allow_image_urls": True} if args.allow_image_urls else {}
    if args.max_image_bytes is not None:
        out["max_image_bytes"] = args.max_image_bytes
    return out


def check_http_args(args) -> None:
    for flag in ("header_timeout", "body_timeout", "keepalive_timeout"):
        value = getattr(args, flag)
        if value is not None and not 0 < value <= 86400:
            raise CliError(f"--{flag.replace('_', '-')} must be between 0 (exclusive) and 86400 seconds, got {value}",
                           code=2)
    if args.max_connections is not None and args.max_connections < 1:
        raise CliError(f"--max-connections must be >= 1, got {args.max_connections}", code=2)


def http_settings(args) -> dict:
    """GatewayConfig fields of the HTTP connection flags the user gave (its defaults apply to the rest)."""
    return {field: getattr(args, dest) for dest, (field, _) in HTTP_FLAGS.items() if getattr(args, dest) is not None}


# --- end of HTTP connection limits -----------------------------------------------------------


def _one_line_usage_error(name: str, message: str):
    print(f"deepinfer {name}: {message} (see deepinfer {name} --help)", file=sys.stderr)
    sys.exit(2)


def _check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be between 0 and 65535, got {args.port}", code=2)
    for flag in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks", "block_size",
                 "max_num_waiting", "num_threads", "max_concurrent_requests", "swa_replay_tokens",
                 "num_draft_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {value}", code=2)
    for flag in ("swa_store_slots", "kv_host_tier_bytes"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 0, got {value}", code=2)
    for flag, name in (("swa_fetch_deadline_s", "--swa-fetch-deadline"), ("kv_load_deadline_s", "--kv-load-deadline")):
        value = getattr(args, flag)
        if value is not None and not 0 < value < 3600:
            raise CliError(f"{name} must be between 0 and 3600 seconds (exclusive), got {value}", code=2)
    if args.ep < 1 or args.ep_redundant_experts < 0:
        raise CliError(f"--ep must be >= 1 and --ep-redundant-experts >= 0, got {args.ep} and "
                       f"{args.ep_redundant_experts}", code=2)
    check_spec_with_ep(args)
    if not 0 <= args.shutdown_grace <= 3600:
        raise CliError(f"--shutdown-grace must be between 0 and 3600 seconds, got {args.shutdown_grace}", code=2)
    if args.api_key is not None and not args.api_key.strip():
        raise CliError("--api-key must not be blank; leave it out to disable authentication", code=2)
    if args.swa_directory_bind is not None:
        if not args.swa_directory_bind.startswith(("tcp://", "ipc://")):
            raise CliError("--swa-directory-bind must be tcp://HOST:PORT or ipc://PATH, "
                           f"got {args.swa_directory_bind!r}", code=2)
        if args.swa_directory is not None:
            raise CliError("give --swa-directory-bind (host the directory here) or --swa-directory (join one), "
                           "not both", code=2)
    if args.kv_store_dir is not None and args.kv_store_nodes is not None:
        raise CliError("give --kv-store-dir (a filesystem store) or --kv-store-nodes (a storage cluster), not both",
                       code=2)
    if args.kv_store_ec is not None and args.kv_store_nodes is None and not envs.get().kv_store_nodes:
        raise CliError("--kv-store-ec needs --kv-store-nodes (the cluster it describes)", code=2)
    if args.disaggregated:
        given = [f"--{f.replace('_', '-')}" for f in ("swa_directory_bind", "swa_directory", "swa_node_name",
                                                      "swa_peer_host", "kv_host_tier_bytes", "kv_store_dir",
                                                      "kv_store_nodes", "kv_store_ec")
                 if getattr(args, f) is not None]
        if given:
            raise CliError(f"{given[0]} is not used with --disaggregated (the gateway hosts the SWA directory; "
                           "the engines keep no KV tiers yet)", code=2)
        # pd-liveness: the --pd-* failure-detection flags must agree (min silence <= max silence ...)
        from deepinfer.runtime.disagg.cli_args import serve_detector

        try:
            serve_detector(args)
        except ValueError as exc:
            raise CliError(f"peer failure detection: {exc}", code=2) from None
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        raise CliError("--served-model-name must not be blank", code=2)


# EngineOptions field names in validation messages -> the flags a serve user typed
_FLAG_NAMES = {"kv_store_nodes": "--kv-store-nodes", "kv_store_ec": "--kv-store-ec", "kv_store_dir": "--kv-store-dir",
               "max_image_bytes": "--max-image-bytes"}


def _flag_message(message: str) -> str:
    for field_name, flag in _FLAG_NAMES.items():
        message = message.replace(field_name, flag)
    return message


def _model_dir(args) -> tuple[Path, bool]:
    """(model directory, whether it is the built-in tiny model)."""
    model = args.model or envs.get().hf_model_dir
    if model:
        path = Path(model).expanduser()
        if not path.is_dir():
            raise CliError(f"--model {model}: no such directory", code=2)
        if not (path / "config.json").is_file():
            raise CliError(f"--model {model}: no config.json there; expected an HF-style model directory", code=2)
        return path, False
    from deepinfer.runtime.gateway.builtin_model import default_model_dir

    try:
        path, created, kind = default_model_dir(show_progress=not args.no_progress)
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    except OSError as exc:
        raise CliError(f"cannot create the built-in tiny model: {exc}") from None
    print(("Created" if created else "Using") + f" the built-in tiny model ({kind}) at {path}")
    return path, True


def engine_options(args) -> dict:
    """EngineOptions fields of the engine flags the user gave (the engine's defaults apply to the rest)."""
    return {flag: getattr(args, flag) for flag in ENGINE_FLAGS if getattr(args, flag, None) is not None}


class _StopRequested(Exception):
    """SIGTERM before the event loop took over signal handling (imports, model creation)."""


def _raise_stop(signum, frame):
    raise _StopRequested()


def run(args) -> int:
    # the loop handles SIGINT/SIGTERM once it runs (launch); before that, the heavy imports and a
    # first-run model creation can take seconds, and a stop request then must not kill us mid-write
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        return _run(args)
    except (_StopRequested, KeyboardInterrupt):
        print("Stopped before the server started.", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args) -> int:
    from deepinfer.engine.core.options import EngineOptions, EngineOptionsError, kv_store_cluster
    from deepinfer.runtime import loop
    from deepinfer.runtime.gateway.config import GatewayConfig
    from deepinfer.runtime.gateway.launcher import LaunchSpec, launch
    from deepinfer.runtime.kv_store_cluster import engine_store_options

    _check_args(args)
    check_http_args(args)
    options = engine_options(args)
    model_dir, is_builtin = _model_dir(args)
    names = tuple(args.served_model_name or ((BUILTIN_MODEL_NAME,) if is_builtin else ()))
    if names:
        options["served_model_name"] = names[0]
    if "show_progress" in {f.name for f in fields(EngineOptions)}:  # the weight-loading progress bar
        options["show_progress"] = not args.no_progress
    try:
        # a cluster config file becomes its storage nodes' addresses here: the engine takes addresses
        options = engine_store_options(options)
        # bad values fail here, before anything loads (a directory hosted here is joined like any)
        checked = EngineOptions.from_kwargs(**options, **({"swa_directory": args.swa_directory_bind}
                                                          if args.swa_directory_bind else {}))
        kv_store_cluster(checked)  # with DEEPINFER_KV_STORE_NODES / _EC applied
        gateway = GatewayConfig(served_model_names=names, api_key=args.api_key,
                                max_concurrent_requests=args.max_concurrent_requests,
                                shutdown_grace_s=args.shutdown_grace, **http_settings(args), **image_settings(args))
    except (EngineOptionsError, ValueError) as exc:
        raise CliError(_flag_message(str(exc)), code=2) from None
    logging.basicConfig(level=envs.get().log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = LaunchSpec(model_dir, args.host, args.port, gateway, options, swa_directory_bind=args.swa_directory_bind,
                      ep_size=args.ep, ep_settings={"redundant_per_rank": args.ep_redundant_experts})
    try:
        if args.disaggregated:  # pd-disagg hook: gateway here, engines as supervised processes
            from deepinfer.runtime.disagg.launch import launch_disaggregated

            return loop.run(launch_disaggregated(spec, args, print_fn=lambda line: print(line, flush=True)))
        return loop.run(launch(spec, print_fn=lambda line: print(line, flush=True)))
    except OSError as exc:  # e.g. the port is taken
        raise CliError(f"cannot serve on {args.host}:{args.port}: {exc.strerror or exc}") from None
    except (EngineOptionsError, ValueError, FileNotFoundError) as exc:
        raise CliError(f"cannot load {model_dir}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                       code=2) from None
