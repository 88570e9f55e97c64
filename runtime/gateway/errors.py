"""OpenAI-format errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every way a request can fail ends here: validation (``GatewayError`` raised by the parsers),
msgspec decode errors (translated so the message names the JSON path), typed engine errors, and
aiohttp's own HTTP exceptions (404 route, 405 method, 413 body too large).
"""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

from deepinfer.engine.sampling_params import SamplingParamsError
from deepinfer.runtime.gateway.engine_client import EngineOverloadedError

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class GatewayError(Exception):
    """A request that cannot be served; ``message`` is one sentence naming what was wrong."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")


class _ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorEnvelope(msgspec.Struct):
    error: _ErrorBody


_encoder = msgspec.json.Encoder()


def error_payload(err: GatewayError) -> bytes:
    return _encoder.encode(_ErrorEnvelope(_ErrorBody(err.message, err.type, err.param, err.code)))


def error_response(err: GatewayError) -> web.Response:
    return web.Response(
        body=error_payload(err), status=err.status, content_type="application/json", headers=err.headers
    )


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> GatewayError:
    return GatewayError(message, status=400, param=param, code=code)


# msgspec says e.g. "Expected `int` >= 1 - at `$.n`" or "Object missing required field `messages`".
_AT_PATH = re.compile(r"^(?P<what>.*?) - at `\$(?P<path>[^`]*)`$", re.S)
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")
_UNKNOWN = re.compile(r"unknown field `(?P<field>[^`]+)`")


def _param_path(path: str) -> str | None:
    path = path.lstrip(".")
    return path or None


def from_decode_error(exc: Exception) -> GatewayError:
    """A msgspec decode/validation error (or a too-deep document) as a 400 naming the field."""
    if isinstance(exc, RecursionError):
        return bad_request("request body is nested too deeply", code="invalid_json")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, msgspec.ValidationError):
        what, path = text, ""
        m = _AT_PATH.match(text)
        if m:
            what, path = m.group("what"), m.group("path")
        param = _param_path(path)
        missing = _MISSING.search(what)
        unknown = _UNKNOWN.search(what)
        if missing:
            param = f"{param}.{missing.group('field')}" if param else missing.group("field")
            return bad_request(f"{param} is required", param, code="missing_required_parameter")
        if unknown:
            field = f"{param}.{unknown.group('field')}" if param else unknown.group("field")
            return bad_request(f"{field} is not a recognised field", field, code="unknown_parameter")
        code = "invalid_type" if what.startswith("Expected `") and "`, got `" in what else "invalid_value"
        if param is None:
            return bad_request(f"request body: {_lower_first(what)}", None, code=code)
        return bad_request(f"{param}: {_lower_first(what)}", param, code=code)
    # DecodeError: the body is not JSON at all
    return bad_request(f"request body is not valid JSON: {text.removeprefix('JSON is malformed: ')}", code="invalid_json")


def from_engine_error(exc: Exception, structured_param: str | None) -> GatewayError | None:
    """Map a typed engine error raised for a request's input; None if it is not an input error."""
    # imported here: the structured-output module pulls in xgrammar and torch
    from deepinfer.engine.structured_output import StructuredOutputError

    if isinstance(exc, EngineOverloadedError):
        retry = max(1, round(exc.retry_after_s))
        return GatewayError(str(exc), status=429, code="queue_full", headers={"Retry-After": str(retry)})
    if isinstance(exc, StructuredOutputError):
        message = f"{structured_param}: {exc}" if structured_param else str(exc)
        return GatewayError(message, status=422, param=structured_param, code="invalid_structured_output")
    if isinstance(exc, SamplingParamsError):
        field = str(exc).split(" ", 1)[0]
        return bad_request(str(exc), field)
    if isinstance(exc, ValueError):
        return bad_request(_one_line(exc))
    return None


def _one_line(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s else s
