"""The gateway role of ``deepinfer node --role gateway`` (registered in runtime/roles.py): the
OpenAI-compatible HTTP gateway over the cluster's prefill and decode engines.

The node's spec names its HTTP endpoint (``http = "http://HOST:PORT"``) and the data address
the decode engines stream outputs to (``data = ...``). It routes with its ``routing`` key, else
the file's ``[gateway] routing`` (tiered | round-robin | affinity-only, runtime/disagg/routing.py),
fills in ``[gateway] traffic_class`` for requests that name none, and applies the section's
failure policy, request timeout and decode silence. The tokenizer and the served model's limits
come from the model directory (``--model``, ``[engine] model`` or DEEPINFER_HF_MODEL_DIR), which
must hold the engines' model; the served name is the directory's name unless
``served_model_name`` is given. ``/health`` answers 503 until a prefill and a decode engine are
up, so the HTTP port opens at once and load balancers wait for health. ``/metrics`` carries the
gateway's own counters and the router's (``deepinfer_router_*``).
"""

from __future__ import annotations

from pathlib import Path

from deepinfer.runtime.balance import PrefillRouterConfig
from deepinfer.runtime.cluster_config import ClusterConfig, NodeRole
from deepinfer.runtime.disagg.node_role import model_dir_of
from deepinfer.transport.protocol import FailurePolicy


class GatewayRole:
    def __init__(self, config: ClusterConfig, node_name: str, model_dir: str, *, served_model_name: str | None = None,
                 engine_options: dict | None = None):
        spec = config.node(node_name)
        if not spec.http:
            raise ValueError(f"nodes.{node_name}.http: a gateway node needs its HTTP endpoint (http://HOST:PORT)")
        if not spec.data:
            raise ValueError(f"nodes.{node_name}.data: a gateway node needs a data address for the engines' streams")
        self.config = config
        self.node_name = node_name
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name or self.model_dir.name
        self.engine_options = {**config.engine.options(), **(engine_options or {})}
        host, _, port = spec.http.removeprefix("http://").rpartition(":")
        self.host, self.port = host, int(port)
        self.client = None
        self.gateway = None

    @property
    def num_in_flight(self) -> int:
        return 0 if self.client is None else self.client.num_in_flight

    async def start(self, node) -> None:
        from deepinfer.runtime.disagg.client import PdEngineClient
        from deepinfer.runtime.disagg.launch import load_model_info, load_vision
        from deepinfer.runtime.gateway.config import GatewayConfig
        from deepinfer.runtime.gateway.embedded import start_gateway

        section = self.config.gateway
        info, tokenizer = load_model_info(self.model_dir, self.engine_options, self.served_model_name)
        policy = FailurePolicy.FAIL if section.failure_policy == "fail" else FailurePolicy.RECOMPUTE
        # a cluster with encoder nodes reads images: the gateway prepares and prices them
        has_encoders = any(n.role.value == "encoder" for n in self.config.nodes)
        self.client = PdEngineClient(self.config, gateway_name=self.node_name, model_info=info, tokenizer=tokenizer,
                                     vision=load_vision(self.model_dir) if has_encoders else None,
                                     failure_policy=policy, request_timeout_s=section.request_timeout_s,
                                     decode_silence_s=section.decode_silence_s, ctx=node.ctx,
                                     routing=self.config.routing_of(self.node_name),
                                     default_traffic_class=section.traffic_class,
                                     router_config=PrefillRouterConfig(load_noise_s=section.load_noise_s))
        await self.client.start()
        try:
            self.gateway = await start_gateway(self.client, GatewayConfig(served_model_names=(self.served_model_name,)),
                                               host=self.host, port=self.port)
        except BaseException:
            await self.client.close()
            raise

    async def drain(self, deadline_s: float) -> None:
        if self.gateway is not None:  # stops listening, lets requests in flight finish (grace), cancels the rest
            await self.gateway.close()
            self.gateway = None

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.close()
            self.gateway = None
        if self.client is not None:
            await self.client.close()
            self.client = None


def make_role(*, role: NodeRole, config: ClusterConfig, node_name: str, model: str | None = None,
              engine_options: dict | None = None, **_: object) -> GatewayRole:
    if role is not NodeRole.GATEWAY:
        raise ValueError(f"node {node_name}: the gateway role serves gateway nodes, not {role.value}")
    return GatewayRole(config, node_name, model_dir_of(config, model),
                       served_model_name=(engine_options or {}).get("served_model_name"), engine_options=engine_options)
