"""Hostile HTTP against a real gateway on a loopback port, spoken over raw sockets.

Broken framing and parser limits get an OpenAI-format JSON error and one log line, never a
traceback; slow, silent and idle connections are closed within their deadlines; a flood of slow
connections beyond the cap is refused at once while an open client keeps being served; a huge
model or field name is not echoed back whole. The FakeEngine stands in for the model (the
HTTP layer is the subject); the last test runs the real `deepinfer serve` with the flags.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time

import pytest

from deepinfer.runtime.gateway import GatewayConfig, start_gateway
from deepinfer.runtime.gateway.connections import EveryInterval, connection_cap
from deepinfer.runtime.gateway.errors import MAX_ECHO_CHARS, GatewayError, echo
from tests.conftest import load_test_helper

harness = load_test_helper("runtime/gateway_harness")
proc = load_test_helper("runtime/gateway_process")

HOST = "127.0.0.1"
READ_LIMIT_S = 5.0  # generous: every answer below comes in milliseconds when the server is right


# -- raw HTTP ---------------------------------------------------------------------------------

async def read_until_closed(reader: asyncio.StreamReader, limit_s: float = READ_LIMIT_S) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took.
    TimeoutError if it is still open after ``limit_s``."""
    t0 = time.monotonic()
    data = b""

    async def drain() -> None:
        nonlocal data
        while chunk := await reader.read(65536):
            data += chunk

    try:
        await asyncio.wait_for(drain(), limit_s)
    except ConnectionError:  # a reset after the server closed: what came before it counts
        pass
    return data, time.monotonic() - t0


async def send_raw(port: int, *parts: bytes, pause_s: float = 0.0) -> tuple[bytes, float]:
    """Open a connection, send ``parts`` (``pause_s`` apart) while reading, until the server
    closes it; (what it sent, seconds from connecting to its close)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    reading = asyncio.ensure_future(read_until_closed(reader))
    try:
        for i, part in enumerate(parts):
            if i and pause_s:
                await asyncio.wait([reading], timeout=pause_s)
            if reading.done():  # closed by the server: stop sending
                break
            try:
                writer.write(part)
                await writer.drain()
            except ConnectionError:
                break
        return await reading
    finally:
        reading.cancel()
        writer.close()


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), {k.lower(): v for k, v in headers.items()}, body


def openai_error(body: bytes) -> dict:
    doc = json.loads(body)
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    return doc["error"]


async def read_one_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response with a Content-Length body, leaving the connection open."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_LIMIT_S)
    status, headers, _ = parse_response(head)
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), READ_LIMIT_S)
    return status, body


def request(method: str, path: str, body: bytes | None = None, extra: bytes = b"") -> bytes:
    length = b"" if body is None else b"Content-Length: %d\r\n" % len(body)
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\n".encode() + b"Content-Type: application/json\r\n" + length
            + extra + b"\r\n" + (body or b""))


# -- broken framing and parser limits (a JSON 400, one log line, no traceback) -------------------

COMPLETION = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
CHUNKED_HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
MALFORMED = {  # name -> (parts sent 0.2 s apart, status, error code)
    "header over 8 KB": ([b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"], 400,
                         "http_line_too_long"),
    "request line over 8 KB": ([b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"], 400, "http_line_too_long"),
    "200 headers": ([b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(200))
                     + b"\r\n"], 400, "malformed_http"),
    "bad chunk size": ([CHUNKED_HEAD + b"ZZZ\r\nabc\r\n0\r\n\r\n"], 400, "malformed_http"),
    # the head is served first, then the broken chunk arrives while the handler reads the body
    "bad chunk size, later packet": ([CHUNKED_HEAD, b"5\r\n{\"pro\r\nZZZ\r\n"], 400, "malformed_http"),
    "Content-Length with Transfer-Encoding": (
        [request("POST", "/v1/completions", COMPLETION, b"Transfer-Encoding: chunked\r\n")], 400, "malformed_http"),
    "POST body without Content-Length": ([request("POST", "/v1/completions") + COMPLETION], 400,
                                         "invalid_http_method"),
    "POST without Content-Length or body": ([request("POST", "/v1/completions")], 411, "length_required"),
    "unknown method": ([b"FROB /health HTTP/1.1\r\nHost: x\r\n\r\n"], 400, "invalid_http_method"),
    "bad HTTP version": ([b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n"], 400, "malformed_http"),
    "TLS on the HTTP port": ([b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40], 400,
                             "malformed_http"),
}


@pytest.fixture
async def gateway(port):
    engine = harness.fake_engine()
    gateway = await start_gateway(engine, None, host=HOST, port=port)
    try:
        yield gateway
    finally:
        await gateway.close()


@pytest.mark.timeout(60)
async def test_malformed_http_gets_json_errors_and_one_log_line(gateway, caplog):
    caplog.set_level(logging.DEBUG)
    for name, (parts, status, code) in MALFORMED.items():
        caplog.clear()
        raw, _ = await send_raw(gateway.port, *parts, pause_s=0.2)
        got_status, headers, body = parse_response(raw)
        assert (got_status, headers.get("content-type", "").split(";")[0]) == (status, "application/json"), \
            (name, raw[:300])
        error = openai_error(body)
        assert error["code"] == code and error["type"] == "invalid_request_error", (name, error)
        assert len(error["message"]) < 600, name
        tracebacks = [r.getMessage() for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
        assert not tracebacks, (name, tracebacks)
        lines = [r for r in caplog.records if r.levelno >= logging.INFO and r.name.startswith(("deepinfer", "aiohttp"))]
        assert len(lines) <= 1, (name, [r.getMessage() for r in lines])
    # the server is unharmed
    raw, _ = await send_raw(gateway.port, request("GET", "/health", extra=b"Connection: close\r\n"))
    assert parse_response(raw)[0] == 200


# -- echoed names are bounded -------------------------------------------------------------------

@pytest.mark.timeout(60)
async def test_error_messages_do_not_echo_huge_names(gateway):
    huge = "m" * (1 << 20)
    cases = [
        ("/v1/chat/completions", {"model": huge, "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ("/v1/completions", {"model": huge, "prompt": "hi"}, 404, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                  "stream_options": {huge: 1}}, 400, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": huge}}, 400, None),
    ]
    for path, body, status, param in cases:
        raw, _ = await send_raw(gateway.port, request("POST", path, json.dumps(body).encode(),
                                                      b"Connection: close\r\n"))
        got_status, _, reply = parse_response(raw)
        assert got_status == status, raw[:300]
        assert len(reply) < 2048, (path, len(reply))
        error = openai_error(reply)
        if param:
            assert error["param"] == param
        assert "m" * MAX_ECHO_CHARS in error["message"] or "characters)" in error["message"], error
    # a name in the URL: as long as the request line allows
    name = "n" * 8000
    raw, _ = await send_raw(gateway.port, request("GET", f"/v1/models/{name}", extra=b"Connection: close\r\n"))
    got_status, _, reply = parse_response(raw)
    assert got_status == 404 and len(reply) < 1024
    assert f"({len(name)} characters)" in openai_error(reply)["message"]


def test_echo_and_message_bounds():
    assert echo("tiny") == "'tiny'"
    cut = echo("x" * 10_000)
    assert cut.startswith("'" + "x" * MAX_ECHO_CHARS + "'") and cut.endswith("(10000 characters)")
    err = GatewayError("y" * 100_000, param="p" * 100_000)
    assert len(err.message) < 1100 and len(err.param) < 300


# -- deadlines ---------------------------------------------------------------------------------

SHORT = GatewayConfig(header_timeout_s=0.5, body_timeout_s=0.5, keepalive_timeout_s=0.5)
CLOSE_BOUND_S = 3.0  # the deadlines are 0.5 s; the rest is slack for a loaded 2-core machine


@pytest.fixture
async def short_gateway(port):
    gateway = await start_gateway(harness.fake_engine(), SHORT, host=HOST, port=port)
    try:
        yield gateway
    finally:
        await gateway.close()


@pytest.mark.timeout(60)
async def test_slow_silent_and_idle_connections_are_closed(short_gateway):
    port = short_gateway.port

    async def closed_after(*parts: bytes, pause_s: float = 0.0) -> tuple[bytes, float]:
        t0 = time.monotonic()
        raw, _ = await send_raw(port, *parts, pause_s=pause_s)
        return raw, time.monotonic() - t0

    async def silent():
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            return await read_until_closed(reader)
        finally:
            writer.close()

    async def idle_after_one_request():
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            writer.write(request("GET", "/health"))
            status, _ = await read_one_response(reader)
            assert status == 200
            return await read_until_closed(reader)
        finally:
            writer.close()

    partial_head = closed_after(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    # one byte every 0.1 s: the header deadline is for the whole head, not between bytes
    trickled_head = closed_after(*[bytes([b]) for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: yes\r\n"],
                                 pause_s=0.1)
    partial_body = closed_after(request("POST", "/v1/completions", COMPLETION)[:-10])
    results = await asyncio.gather(partial_head, trickled_head, partial_body, silent(), idle_after_one_request())
    for name, (raw, seconds) in zip(("partial head", "trickled head", "partial body", "silent", "idle"), results):
        assert seconds < CLOSE_BOUND_S, (name, seconds)
        if name in ("silent", "idle"):
            assert raw == b"", (name, raw)  # closed without a word: nothing was asked
            continue
        status, _, body = parse_response(raw)
        code = "body_timeout" if name == "partial body" else "header_timeout"
        assert status == 408 and openai_error(body)["code"] == code, (name, raw)
    # a well-behaved request still works under the short deadlines
    raw, _ = await send_raw(port, request("POST", "/v1/completions", COMPLETION, b"Connection: close\r\n"))
    assert parse_response(raw)[0] == 200


# -- the connection cap --------------------------------------------------------------------------

@pytest.mark.timeout(60)
async def test_slowloris_flood_beyond_the_cap_leaves_served_clients_working(port):
    cap, flood = 12, 60
    config = GatewayConfig(max_connections=cap, header_timeout_s=4.0)
    gateway = await start_gateway(harness.fake_engine(), config, host=HOST, port=port)
    writers = []
    try:
        # a well-behaved client holding a keep-alive connection from before the flood
        reader, writer = await asyncio.open_connection(HOST, port)
        writers.append(writer)
        writer.write(request("GET", "/health"))
        assert (await read_one_response(reader))[0] == 200

        t0 = time.monotonic()
        conns = [await asyncio.open_connection(HOST, port) for _ in range(flood)]
        writers += [w for _, w in conns]
        await asyncio.sleep(0.3)  # the server accepts (or refuses) them

        async def fate(conn) -> str:
            r, w = conn
            try:
                raw = await asyncio.wait_for(r.read(65536), 1.5)
            except TimeoutError:  # held open: behave like slowloris
                w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                return "held"
            except ConnectionResetError:
                return "refused"
            if raw:
                status, _, body = parse_response(raw)
                assert status == 503 and openai_error(body)["code"] == "too_many_connections", raw
            return "refused"

        fates = await asyncio.gather(*(fate(c) for c in conns))
        assert time.monotonic() - t0 < 3.5  # refusals are immediate, well inside the header deadline
        assert fates.count("held") == cap - 1, fates  # the served client holds one slot
        # the served client keeps working during the flood
        writer.write(request("POST", "/v1/completions", COMPLETION))
        status, body = await read_one_response(reader)
        assert status == 200 and json.loads(body)["choices"], body
        # the flood's held connections die at the header deadline; new clients get in again
        held = [c for c, f in zip(conns, fates) if f == "held"]
        closed = await asyncio.gather(*(read_until_closed(r, 6.0) for r, _ in held))
        assert all(parse_response(raw)[0] == 408 for raw, _ in closed)
        raw, _ = await send_raw(port, request("GET", "/health", extra=b"Connection: close\r\n"))
        assert parse_response(raw)[0] == 200
    finally:
        for w in writers:
            w.close()
        await gateway.close()


# -- pure pieces and the CLI -----------------------------------------------------------------------

def test_connection_cap_fits_the_open_file_limit():
    assert connection_cap(1000, 20000) == 1000
    assert connection_cap(1000, 1024) == 768  # FD_RESERVE kept for the engine
    assert connection_cap(1000, 256) == 128  # a small limit: half of it
    assert connection_cap(1000, -1) == 1000  # unlimited
    assert connection_cap(5, 3) == 1


def test_refusal_log_is_throttled():
    every = EveryInterval(10.0)
    assert [every.tick(t) for t in (0.0, 1.0, 2.0, 9.9, 10.0, 10.5, 25.0)] == [1, 0, 0, 0, 4, 0, 2]


@pytest.mark.parametrize("field", ["header_timeout_s", "body_timeout_s", "keepalive_timeout_s"])
def test_config_rejects_bad_deadlines(field):
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=field):
            GatewayConfig(**{field: bad})
    with pytest.raises(ValueError, match="max_connections"):
        GatewayConfig(max_connections=0)


def test_serve_flags_defaults_match_the_gateway_config(tmp_path, capsys):
    from deepinfer.bin import serve

    defaults = GatewayConfig()
    for dest, (field, shown) in serve.HTTP_FLAGS.items():
        assert getattr(defaults, field) == shown, field
    for i, (argv, flag) in enumerate([(["--header-timeout", "0"], "--header-timeout"),
                                      (["--body-timeout", "nan"], "--body-timeout"),
                                      (["--max-connections", "0"], "--max-connections")]):
        (tmp_path / str(i)).mkdir()
        code, err = proc.serve_usage_error(tmp_path / str(i), capsys, argv)
        assert code == 2 and flag in err and "\n" not in err, err


@pytest.mark.timeout(120)
def test_deepinfer_serve_applies_the_flags(port):
    """The real command: its flags reach the server, and its log has no traceback for bad HTTP."""
    env = {**proc.serve_env(harness.TEST_CACHE_DIR), "DEEPINFER_LOG_LEVEL": "INFO"}
    args = ["--model", str(harness.tiny_model_dir()), "--max-model-len", "2048", "--keepalive-timeout", "0.5",
            "--header-timeout", "0.5", "--max-connections", "4"]
    with proc.Served(args, env, port) as served:
        def exchange(data: bytes) -> tuple[bytes, float]:
            with socket.create_connection((HOST, port), timeout=READ_LIMIT_S) as s:
                t0 = time.monotonic()
                s.sendall(data)
                raw = b""
                while chunk := s.recv(65536):
                    raw += chunk
                return raw, time.monotonic() - t0

        raw, _ = exchange(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
        assert parse_response(raw)[0] == 400 and openai_error(parse_response(raw)[2])["code"] == "http_line_too_long"
        raw, seconds = exchange(request("GET", "/health"))  # kept alive, then closed when idle
        assert parse_response(raw)[0] == 200 and seconds < CLOSE_BOUND_S
        raw, seconds = exchange(b"GET /health HTTP/1.1\r\n")
        assert parse_response(raw)[0] == 408 and seconds < CLOSE_BOUND_S
        code, out, err, _ = served.stop(signal.SIGTERM)
    assert code == 0, err
    assert "Traceback" not in err and "Traceback" not in out
    assert "refused malformed HTTP" in err
