"""``deepinfer serve --disaggregated``: gateway + N prefill + M decode engines (+ K vision encoders) on this machine.

    async with LocalPdCluster(model_dir, num_prefill=1, num_decode=2) as cluster:
        client = cluster.client          # an EngineClient: mount it on the HTTP gateway
        cluster.supervisor.kill("decode-1")   # failure tests

The engines are separate ``deepinfer node --role prefill|decode`` processes under a
``Supervisor`` (restarted when they die; a restart is a new instance to everyone; they stop and
remove the cluster's socket directory if this process dies, ``kill -9`` included); the gateway
and its ``PdEngineClient`` run in this process, and so does the SWA slot directory
(``cluster.swa_directory``) when ``swa_store_slots`` > 0: the prefill engines list and fetch
their slots through it, and a prefill engine's PeerDown drops its slots. bin/serve.py calls ``launch_disaggregated`` when
``--disaggregated`` is given (``add_disagg_arguments`` adds the flags).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from deepinfer.cache.swa_directory import SwaDirectoryService
from deepinfer.engine.api.protocol import ModelInfo
from deepinfer.runtime.disagg.cli_args import add_disagg_arguments, serve_detector  # noqa: F401 (re-exported)
from deepinfer.runtime.disagg.client import PdEngineClient
from deepinfer.runtime.disagg.local_cluster import write_local_cluster
from deepinfer.runtime.failure_detector import DetectorSettings
from deepinfer.runtime.supervisor import ChildSpec, Supervisor
from deepinfer.transport.protocol import FailurePolicy

log = logging.getLogger(__name__)

# node flags whose name is not the option's (bin/node.py takes the serve spellings)
_FLAG_NAMES = {"swa_fetch_deadline_s": "--swa-fetch-deadline"}

_NODE_FLAGS = ("max_num_seqs", "num_blocks", "max_model_len", "block_size", "dtype", "quantization", "num_threads",
               "swa_replay", "swa_replay_tokens", "swa_store_slots", "swa_fetch_deadline_s",
               "speculative", "num_draft_tokens", "spec_schedule")
_DECODE_ONLY = ("speculative", "num_draft_tokens", "spec_schedule")  # DSpark: the decode engines draft


def load_vision(model_dir: Path):
    """The model's image preprocessing (no tower: the encoder nodes hold it); ValueError without one."""
    from deepinfer.engine.mm.encoder import VisionEncoder
    from deepinfer.engine.models.registry import read_model_config

    vision = VisionEncoder.for_config(read_model_config(model_dir))
    if vision is None:
        raise ValueError(f"--encoders: {model_dir} has no vision tower (config.json has no vision_config)")
    return vision


def load_model_info(model_dir: Path, options: Mapping[str, Any], name: str) -> tuple[ModelInfo, Any]:
    from deepinfer.engine.models.registry import read_model_config
    from deepinfer.engine.text.tokenizer import Tokenizer

    cfg = read_model_config(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    max_len = min(options.get("max_model_len") or cfg.max_position_embeddings, cfg.max_position_embeddings)
    if options.get("num_blocks"):
        max_len = min(max_len, options["num_blocks"] * options.get("block_size", 128))
    eos = tuple(tokenizer.eos_token_ids or cfg.eos_token_id or ())
    return ModelInfo(name, max_len, cfg.vocab_size, eos, int(time.time())), tokenizer


class LocalPdCluster:
    def __init__(self, model_dir: str | Path, *, num_prefill: int = 1, num_decode: int = 1,
                 engine_options: Mapping[str, Any] | None = None, transport: str = "ipc",
                 failure_policy: FailurePolicy = FailurePolicy.RECOMPUTE, request_timeout_s: float = 300.0,
                 lease_s: float = 5.0, heartbeat_interval_s: float = 0.2, served_model_name: str | None = None,
                 log_dir: str | Path | None = None, env: Mapping[str, str] | None = None,
                 decode_silence_s: float = 15.0, detector: DetectorSettings | None = None, num_encoders: int = 0,
                 ep_size: int = 1, ep_redundant_experts: int = 0):
        self.model_dir = Path(model_dir)
        if ep_size < 1 or ep_redundant_experts < 0:
            raise ValueError(f"ep_size must be >= 1 and ep_redundant_experts >= 0, got {ep_size} and "
                             f"{ep_redundant_experts}")
        # each prefill/decode node an EP group of ep_size rank processes (runtime/ep/node_group.py)
        self.ep_size, self.ep_redundant_experts = ep_size, ep_redundant_experts
        self.num_prefill, self.num_decode = num_prefill, num_decode
        if num_encoders < 0:
            raise ValueError(f"num_encoders must be >= 0, got {num_encoders}")
        self.num_encoders = num_encoders  # vision encoder nodes (runtime/encoder/): images are encoded there
        self.engine_options = {k: v for k, v in dict(engine_options or {}).items() if v is not None}
        unknown = sorted(set(self.engine_options) - set(_NODE_FLAGS) - {"served_model_name", "show_progress"})
        if unknown:
            raise ValueError(f"engine option {unknown[0]!r} is not supported by disaggregated engines; "
                             f"supported: {', '.join(_NODE_FLAGS)}")
        self.transport = transport
        self.failure_policy = failure_policy
        self.request_timeout_s = request_timeout_s
        self.decode_silence_s = decode_silence_s
        self.lease_s = lease_s
        # how the gateway and the engines judge each other (heartbeat_interval_s: the shorthand)
        self.detector = detector or DetectorSettings(interval_s=heartbeat_interval_s)
        self.served_model_name = served_model_name or self.engine_options.get("served_model_name") or self.model_dir.name
        self.log_dir = log_dir
        self.env = dict(env or {})
        self.root: Path | None = None
        self.config = None
        self.supervisor: Supervisor | None = None
        self.client: PdEngineClient | None = None
        self.swa_directory: SwaDirectoryService | None = None

    def engine_names(self) -> list[str]:
        return [f"prefill-{i}" for i in range(self.num_prefill)] + [f"decode-{j}" for j in range(self.num_decode)]

    def encoder_names(self) -> list[str]:
        return [f"encoder-{k}" for k in range(self.num_encoders)]

    def _argv(self, cluster_path: Path, name: str) -> list[str]:
        role = name.split("-")[0]
        if role == "encoder":  # the vision tower only: the model, its dtype and threads
            argv = [sys.executable, "-m", "deepinfer.bin", "node", "--role", role, "--cluster", str(cluster_path),
                    "--name", name, "--model", str(self.model_dir)]
            for key in ("dtype", "num_threads"):
                if key in self.engine_options:
                    argv += [f"--{key.replace('_', '-')}", str(self.engine_options[key])]
            return argv
        argv = [sys.executable, "-m", "deepinfer.bin", "node", "--role", role, "--cluster", str(cluster_path),
                "--name", name, "--model", str(self.model_dir), "--lease-s", str(self.lease_s)]
        for key in _NODE_FLAGS:
            if key in self.engine_options and (role == "decode" or key not in _DECODE_ONLY):
                flag = _FLAG_NAMES.get(key, f"--{key.replace('_', '-')}")
                argv += [flag, str(self.engine_options[key])]
        if role == "prefill" and self.swa_directory is not None:
            argv += ["--swa-directory", self.swa_directory.address]
        if self.ep_size > 1:
            argv += ["--ep", str(self.ep_size), "--ep-redundant-experts", str(self.ep_redundant_experts)]
        return argv

    def _swa_directory_address(self) -> str | None:
        """Where the SWA directory binds: None when the prefill engines keep no slot store."""
        if not self.engine_options.get("swa_store_slots"):  # no store (the default): nothing to share
            return None
        if self.transport == "tcp":
            return "tcp://127.0.0.1:*"
        return f"ipc://{self.root / 'swa-directory'}"

    async def start(self, ready_timeout_s: float = 180.0) -> "LocalPdCluster":
        path, self.config = write_local_cluster(self.num_prefill, self.num_decode, transport=self.transport,
                                                detector=self.detector, num_encoders=self.num_encoders)
        self.root = path.parent
        try:
            address = self._swa_directory_address()
            if address is not None:
                self.swa_directory = SwaDirectoryService(address, name="gateway-swa-directory")
                await self.swa_directory.start()
            children = [ChildSpec(n, self._argv(path, n), self.env) for n in self.engine_names() + self.encoder_names()]
            self.supervisor = Supervisor(children,
                                         log_dir=self.log_dir, cleanup_dir=self.root, on_exit=self._on_engine_exit)
            await self.supervisor.start()
            info, tokenizer = load_model_info(self.model_dir, self.engine_options, self.served_model_name)
            self.client = PdEngineClient(self.config, gateway_name="gateway-0", model_info=info, tokenizer=tokenizer,
                                         failure_policy=self.failure_policy, request_timeout_s=self.request_timeout_s,
                                         decode_silence_s=self.decode_silence_s,
                                         vision=load_vision(self.model_dir) if self.num_encoders else None)
            if self.swa_directory is not None:  # a prefill engine that went down takes its slots with it
                self.client.directory.add_listener(self.swa_directory.directory.on_peer_event)
            await self.client.start()
            await self.client.wait_ready(ready_timeout_s)
            await self.wait_engines_up(ready_timeout_s)
            if self.num_encoders:
                await self.wait_encoders_up(ready_timeout_s)
        except BaseException:
            await self.close()
            raise
        return self

    def _on_engine_exit(self, name: str, status: int) -> None:
        """An engine process of ours exited: a known death, down at once (before any restart)."""
        if self.client is not None and name in self.engine_names():  # an encoder's: the pool's probes see it
            self.client.directory.process_exited(name)

    async def wait_engines_up(self, timeout_s: float, names: list[str] | None = None) -> None:
        """Until every named engine (default: all) is up as seen by the gateway."""
        names = names or self.engine_names()
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while not all(self.client.directory.engines[n].is_up for n in names):
            if loop.time() > end:
                down = [n for n in names if not self.client.directory.engines[n].is_up]
                raise TimeoutError(f"engines {down} did not come up within {timeout_s:g}s")
            await self.client.directory.wait_changed(0.1)

    async def wait_encoders_up(self, timeout_s: float) -> None:
        """Until every encoder answers the gateway's encoder pool."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            statuses = await self.client.encoders.statuses()
            down = [n for n, s in statuses.items() if s is None]
            if not down:
                return
            if loop.time() > end:
                raise TimeoutError(f"encoders {down} did not come up within {timeout_s:g}s")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.supervisor is not None:
            await self.supervisor.stop()
            self.supervisor = None
        if self.swa_directory is not None:
            await self.swa_directory.close()
            self.swa_directory = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    async def __aenter__(self) -> "LocalPdCluster":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def launch_disaggregated(spec, args, *, print_fn: Callable[[str], None] = print,
                               stop: asyncio.Event | None = None) -> int:
    """What ``deepinfer serve --disaggregated`` runs: ``spec`` is the gateway launcher's
    LaunchSpec (model_dir, host, port, gateway config, engine options)."""
    from deepinfer.runtime.gateway.embedded import serve, stop_on_signals

    stop = stop or asyncio.Event()
    policy = FailurePolicy.FAIL if args.failure_policy == "fail" else FailurePolicy.RECOMPUTE
    num_encoders = getattr(args, "encoders", 0) or 0
    cluster = LocalPdCluster(spec.model_dir, num_prefill=args.prefill, num_decode=args.decode,
                             engine_options=spec.engine_options, transport=args.pd_transport, failure_policy=policy,
                             decode_silence_s=args.pd_decode_silence, detector=serve_detector(args),
                             num_encoders=num_encoders, ep_size=spec.ep_size,
                             ep_redundant_experts=spec.ep_settings.get("redundant_per_rank", 0))
    with stop_on_signals(stop):
        encoders = f" + {num_encoders} vision encoders" if num_encoders else ""
        ep = f" (each expert-parallel over {spec.ep_size} ranks)" if spec.ep_size > 1 else ""
        print_fn(f"Starting {args.prefill} prefill + {args.decode} decode engines{ep}{encoders} on {spec.model_dir} ...")
        starting = asyncio.ensure_future(cluster.start())
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await cluster.close()
            print_fn("Stopped before the engines were up.")
            return 0
        starting.result()
        try:
            await serve(cluster.client, host=spec.host, port=spec.port, config=spec.gateway, print_fn=print_fn,
                        stop=stop, handle_signals=False)
            print_fn("Shutting down ...")
        finally:
            await cluster.close()
    print_fn("Stopped.")
    return 0
