"""OpenAI-compatible HTTP gateway (aiohttp) over any ``EngineClient``.

    app = build_app(engine, GatewayConfig(api_key=...))          # mount in your own runner
    runner = GatewayRunner(app, config)                          # ... with the connection limits
    gw = await start_gateway(engine, host="127.0.0.1", port=0)   # or bind one here
    await serve(engine, host=..., port=..., api_key=...)         # what `deepinfer serve` runs
"""

from deepinfer.engine.api.protocol import (
    EngineClient,
    EngineOverloadedError,
    EngineStats,
    GatewayTokenizer,
    ModelInfo,
    TokensPrompt,
)
from deepinfer.runtime.gateway.app import build_app
from deepinfer.runtime.gateway.config import GatewayConfig
from deepinfer.runtime.gateway.connections import GatewayRunner
from deepinfer.runtime.gateway.embedded import RunningGateway, curl_example, serve, start_gateway

__all__ = [
    "EngineClient",
    "EngineOverloadedError",
    "EngineStats",
    "GatewayConfig",
    "GatewayRunner",
    "GatewayTokenizer",
    "ModelInfo",
    "RunningGateway",
    "TokensPrompt",
    "build_app",
    "curl_example",
    "serve",
    "start_gateway",
]
