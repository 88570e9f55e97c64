"""The gateway's settings (one frozen value) and the per-app state handlers read."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from aiohttp import web

from deepinfer.engine.api.protocol import EngineClient
from deepinfer.runtime.gateway.metrics import GatewayMetrics


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    # names a request's ``model`` may use; empty = the engine's model name only
    served_model_names: tuple[str, ...] = ()
    # bearer token required on /v1/* when set (health, metrics and version stay open)
    api_key: str | None = None
    # largest request body accepted (HTTP 413 beyond)
    max_body_bytes: int = 4 * 1024 * 1024
    # n per prompt, and prompts x n per request
    max_n: int = 16
    max_choices: int = 64
    max_stop_strings: int = 16
    # generation requests served at once (HTTP 429 beyond); None = let the engine's queue decide
    max_concurrent_requests: int | None = None
    retry_after_s: int = 1
    # /v1/completions default max_tokens (OpenAI's); chat defaults to the rest of the context
    default_completion_max_tokens: int = 16
    # on shutdown, requests in flight get this long to finish before they are cancelled (aborted)
    shutdown_grace_s: float = 5.0
    # HTTP connections (runtime/gateway/connections.py). A connection gets header_timeout_s from
    # accept (or from the first byte of a later request) to send complete headers, then
    # body_timeout_s for the whole body (HTTP 408 and closed beyond either); an idle keep-alive
    # connection is closed after keepalive_timeout_s. Beyond max_connections open at once a new
    # connection gets HTTP 503 and is closed at once (lowered to fit the open-file limit).
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    max_connections: int = 1000
    # chat image_url parts (chat_images.py): data URLs always; http(s) URLs fetched only when
    # allowed; one image's encoded bytes at most max_image_bytes (a 400 beyond)
    allow_image_urls: bool = False
    max_image_bytes: int = 2 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_n < 1 or self.max_choices < 1:
            raise ValueError("max_n and max_choices must be >= 1")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            value = getattr(self, name)
            if not (0 < value and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.max_image_bytes < 1:
            raise ValueError(f"max_image_bytes must be >= 1, got {self.max_image_bytes}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be blank; leave it unset to disable authentication")


@dataclass(slots=True)
class GatewayState:
    engine: EngineClient
    config: GatewayConfig
    metrics: GatewayMetrics
    model_names: tuple[str, ...]
    num_in_flight: int = 0  # generation requests being served now
    # tasks running a handler now; shutdown cancels those still running after the grace period
    handler_tasks: set[asyncio.Task] = field(default_factory=set)


STATE_KEY = web.AppKey("deepinfer_gateway_state", GatewayState)
