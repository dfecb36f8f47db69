"""The server's idle keep-alive (``--timeout-keep-alive``) on a real uvicorn socket, with the
settings ``python -m jfp8kv.serve`` builds (``uvicorn_config``, through
``bench.keepalive.serve_in_thread``) around a stub app: an idle
connection outlives httpx's 5 s pool expiry by default (at uvicorn's 5 s a request on a pooled
connection can meet the server's close: likely the H100 soak's ReadErrors), the flag sets it, and a
value that cannot work is refused by name."""

from __future__ import annotations

import socket
import time

import pytest

from bench.keepalive import serve_in_thread
from jfp8kv.serve.__main__ import parse_args

REQUEST = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"


async def _ok_app(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _response(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"ok"):
        chunk = conn.recv(4096)
        if not chunk:
            return data
        data += chunk
    return data


def _idle_then_request(argv, idle_s: float) -> tuple[bytes, bytes]:
    server, port = serve_in_thread(_ok_app, argv)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(REQUEST)
            first = _response(conn)
            time.sleep(idle_s)
            try:
                conn.sendall(REQUEST)
                second = _response(conn)
            except (ConnectionResetError, BrokenPipeError):
                second = b""
        return first, second
    finally:
        server.should_exit = True


def test_idle_connection_outlives_an_httpx_pool_by_default():
    first, second = _idle_then_request([], idle_s=6.0)  # httpx expires idle ones at 5 s
    assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"ok")
    assert second.startswith(b"HTTP/1.1 200") and second.endswith(b"ok"), second


def test_timeout_keep_alive_flag_closes_idle_connections():
    first, second = _idle_then_request(["--timeout-keep-alive", "0.5"], idle_s=2.0)
    assert first.startswith(b"HTTP/1.1 200")
    assert second == b""  # the server closed the idle connection: no second answer


@pytest.mark.parametrize("bad", ["0", "-3"])
def test_timeout_keep_alive_must_be_positive(bad, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--timeout-keep-alive", bad])
    assert e.value.code == 2
    assert "--timeout-keep-alive must be > 0 seconds" in capsys.readouterr().err
