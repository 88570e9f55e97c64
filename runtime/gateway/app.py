"""The aiohttp application: routes, authentication, the body deadline, errors as JSON.

``build_app(engine, config)`` mounts any ``EngineClient``. Run it with
``GatewayRunner(app, config, handler_cancellation=True)`` (embedded.py does; connections.py adds
the header and keep-alive deadlines, the connection cap and JSON for broken HTTP): then a client
that disconnects cancels its handler, and the handler's cleanup aborts the engine request at
once, also for non-streaming requests. Streams notice a disconnect on their next write either way.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

import deepinfer
from deepinfer.engine.api.protocol import EngineClient
from deepinfer.runtime.gateway.config import STATE_KEY, GatewayConfig, GatewayState
from deepinfer.runtime.gateway.errors import GatewayError, clip, echo, error_response, malformed_http_error
from deepinfer.runtime.gateway.metrics import GatewayMetrics
from deepinfer.runtime.gateway.openai_responses import ModelCard, ModelList, encoder
from deepinfer.runtime.gateway.response_wire import add_request_id
from deepinfer.runtime.gateway.serving_chat import create_chat_completion
from deepinfer.runtime.gateway.serving_completion import create_completion
from deepinfer.runtime.gateway.serving_responses import create_response

log = logging.getLogger(__name__)


def _http_error(exc: web.HTTPException, max_body_bytes: int) -> GatewayError:
    messages = {
        404: "no such endpoint; see /v1/models, /v1/completions, /v1/chat/completions, /v1/responses",
        405: "method not allowed for this endpoint",
        413: f"request body is too large; the limit is {max_body_bytes} bytes",
    }
    headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
    return GatewayError(messages.get(exc.status, exc.reason or "request failed"), status=exc.status,
                        code=f"http_{exc.status}", headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every failure leaves as OpenAI-format JSON; unexpected ones are logged as 500s."""
    state = request.app[STATE_KEY]
    task = asyncio.current_task()
    state.handler_tasks.add(task)
    try:
        response = await handler(request)
    except GatewayError as err:
        response = error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(_http_error(exc, state.config.max_body_bytes))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        response = error_response(GatewayError("internal server error; see the server log", status=500,
                                               code="internal_error"))
    finally:
        state.handler_tasks.discard(task)
    state.metrics.http_responses.labels(str(response.status)).inc()
    return response


@web.middleware
async def auth_middleware(request: web.Request, handler):
    api_key = request.app[STATE_KEY].config.api_key
    # matched by handler, not path, so it also holds when the app is mounted under a prefix
    if api_key is None or request.match_info.handler in OPEN_HANDLERS:
        return await handler(request)
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise GatewayError("missing or incorrect API key; send 'Authorization: Bearer <key>'", status=401,
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


@web.middleware
async def body_middleware(request: web.Request, handler):
    """Read a routed request's whole body within ``body_timeout_s`` (handlers then read it from
    memory), so a client trickling a body cannot hold a handler; 408 and closed beyond."""
    if request.match_info.http_exception is not None:  # 404 / 405 need no body
        return await handler(request)
    if request.method == "POST" and not request.body_exists and "Content-Length" not in request.headers:
        raise GatewayError("a POST request needs a Content-Length header or chunked Transfer-Encoding", status=411,
                           code="length_required", close_connection=True)
    if request.body_exists:
        timeout = request.app[STATE_KEY].config.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await request.read()  # raises HTTPRequestEntityTooLarge (413) past client_max_size
        except TimeoutError:
            raise GatewayError(f"the request body did not arrive within {timeout:g} s", status=408,
                               code="body_timeout", close_connection=True) from None
        except HttpProcessingError as exc:  # broken chunked framing, a body cut short
            raise malformed_http_error(exc) from None
        except RequestPayloadError as exc:
            raise GatewayError(f"malformed HTTP request body: {clip(str(exc), 256)}", code="malformed_http",
                               close_connection=True) from None
    return await handler(request)


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    info = state.engine.model_info
    cards = [ModelCard(name, info.created, info.max_model_len) for name in state.model_names]
    return web.Response(body=encoder.encode(ModelList(cards)), content_type="application/json")


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    name = request.match_info["model"]
    if name not in state.model_names:
        raise GatewayError(f"the model {echo(name)} does not exist", status=404, param="model", code="model_not_found")
    info = state.engine.model_info
    return web.Response(body=encoder.encode(ModelCard(name, info.created, info.max_model_len)),
                        content_type="application/json")


async def health(request: web.Request) -> web.Response:
    try:
        await request.app[STATE_KEY].engine.check_health()
    except Exception as exc:
        raise GatewayError(f"engine unhealthy: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                           status=503, code="engine_unhealthy") from None
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    gateway_metrics = request.app[STATE_KEY].metrics
    return web.Response(body=gateway_metrics.render(), headers={"Content-Type": gateway_metrics.content_type})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": deepinfer.__version__})


OPEN_HANDLERS = frozenset({health, metrics, version})  # never need the API key


def build_app(engine: EngineClient, config: GatewayConfig | None = None) -> web.Application:
    """The OpenAI-compatible application serving ``engine``."""
    config = config or GatewayConfig()
    names = config.served_model_names or (engine.model_info.name,)
    app = web.Application(middlewares=[errors_middleware, auth_middleware, body_middleware],
                          client_max_size=config.max_body_bytes)
    app.on_response_prepare.append(add_request_id)  # every response, streamed and errors too
    app[STATE_KEY] = GatewayState(engine=engine, config=config, metrics=GatewayMetrics(engine), model_names=names)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    return app
