"""OpenAI-format errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every way a request can fail ends here: validation (``GatewayError`` raised by the parsers),
msgspec decode errors (translated so the message names the JSON path), typed engine errors, and
aiohttp's own HTTP exceptions (404 route, 405 method, 413 body too large), and HTTP that
aiohttp's parser refuses before any handler runs (``malformed_http_error``).

Client text quoted in a message goes through ``echo`` (a 1 MB model name must not make a 1 MB
error body); every message and param is also cut to a bounded length, because some come from
third-party text (msgspec, xgrammar, aiohttp) that may quote the request.
"""

from __future__ import annotations

import re

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong

from deepinfer.engine.api.protocol import EngineOverloadedError, InvalidPromptError, one_line
from deepinfer.engine.api.sampling_params import SamplingParamsError

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    408: "invalid_request_error",
    411: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


# characters of client text quoted in a message, of a whole message, and of a param path
MAX_ECHO_CHARS = 128
MAX_MESSAGE_CHARS = 1024
MAX_PARAM_CHARS = 256


def clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def echo(value: str, limit: int = MAX_ECHO_CHARS) -> str:
    """Client text (a model name, a field name) quoted for an error message, cut to ``limit``."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


class GatewayError(Exception):
    """A request that cannot be served; ``message`` is one sentence naming what was wrong.
    ``close_connection``: the connection cannot carry another request (a body left unread)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close_connection: bool = False,
    ):
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = None if param is None else clip(param, MAX_PARAM_CHARS)
        self.code = code
        self.headers = headers or {}
        self.close_connection = close_connection

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
    response = web.Response(
        body=error_payload(err), status=err.status, content_type="application/json", headers=err.headers
    )
    if err.close_connection:
        response.force_close()
    return response


def malformed_http_error(exc: HttpProcessingError) -> GatewayError:
    """HTTP that aiohttp's parser refused (framing, limits, request line) as a one-line 400."""
    status = exc.code if 400 <= exc.code < 500 else 400
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "the limit of"
        return GatewayError(f"malformed HTTP request: the request line or a header is longer than {limit} bytes",
                            status=status, code="http_line_too_long", close_connection=True)
    if isinstance(exc, BadHttpMethod) and "HTTPS" not in exc.message:
        return GatewayError(f"malformed HTTP request: {_parser_detail(exc)} (an unknown method, or a body sent "
                            "without Content-Length read as the next request)", status=status,
                            code="invalid_http_method", close_connection=True)
    return GatewayError(f"malformed HTTP request: {_parser_detail(exc)}", status=status, code="malformed_http",
                        close_connection=True)


def _parser_detail(exc: HttpProcessingError) -> str:
    # aiohttp's messages span lines: what was wrong, the offending bytes, a line with a ^ pointer
    lines = [ln.strip() for ln in (exc.message or type(exc).__name__).splitlines()]
    detail = " ".join(ln for ln in lines if ln and set(ln) != {"^"})
    return clip(detail, MAX_ECHO_CHARS * 2)


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
            return bad_request(f"{clip(field, MAX_ECHO_CHARS)} is not a recognised field", field,
                               code="unknown_parameter")
        code = "invalid_type" if what.startswith("Expected `") and "`, got `" in what else "invalid_value"
        if param is None:
            return bad_request(f"request body: {_lower_first(what)}", None, code=code)
        return bad_request(f"{param}: {_lower_first(what)}", param, code=code)
    # DecodeError: the body is not JSON at all
    return bad_request(f"request body is not valid JSON: {text.removeprefix('JSON is malformed: ')}", code="invalid_json")


def from_engine_error(exc: Exception, structured_param: str | None,
                      prompt_param: str | None = None) -> GatewayError | None:
    """Map a typed engine error raised for a request's input; None if it is not an input error.
    The engine checks each fact once (the vocabulary, the prompt's length, a full queue): here its
    error becomes the HTTP answer, naming ``prompt_param`` for a prompt the engine refused."""
    # imported here: the structured-output module pulls in xgrammar and torch
    from deepinfer.engine.sample.structured_output import StructuredOutputError

    if isinstance(exc, EngineOverloadedError):
        retry = max(1, round(exc.retry_after_s))
        return GatewayError(str(exc), status=429, code="queue_full", headers={"Retry-After": str(retry)})
    if isinstance(exc, StructuredOutputError):
        message = f"{structured_param}: {exc}" if structured_param else str(exc)
        return GatewayError(message, status=422, param=structured_param, code="invalid_structured_output")
    if isinstance(exc, InvalidPromptError) and prompt_param is not None:
        return bad_request(f"{prompt_param}: {one_line(exc)}", prompt_param)
    if isinstance(exc, SamplingParamsError):
        field = str(exc).split(" ", 1)[0]
        return bad_request(str(exc), field)
    if isinstance(exc, ValueError):
        return bad_request(one_line(exc))
    return None


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s else s
