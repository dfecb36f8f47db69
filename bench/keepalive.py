"""The keep-alive race, reproduced on any machine: does a client pool that reuses idle
connections meet the server closing them?

A stub app served with the settings ``python -m jfp8kv.serve`` builds (``uvicorn_config``,
``--timeout-keep-alive K``) answers every request after blocking its event loop for
``--busy-ms`` (a loaded server's loop: tokenizing, streaming), and an httpx pool (default
expiry 5 s) is driven by ``--clients`` clients that each wait 5 s +- ``--jitter-s`` between
requests plus bursts of ``--burst-size`` requests, for ``--duration`` seconds per K. A
request that meets the server's close ends in a transport error (``httpx.ReadError``); the
JSON counts them per K. Needs no model and no accelerator.

    python -m bench.keepalive --keep-alive 5 75 --out bench/results/keepalive-race-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import threading
import time

import httpx
import uvicorn

from bench.common import command_line, machine_info, write_result
from jfp8kv.serve.__main__ import parse_args, uvicorn_config


def serve_in_thread(app, argv: list[str]) -> tuple[uvicorn.Server, int]:
    """``app`` under uvicorn with the settings the server's flags ``argv`` give
    (``uvicorn_config``), on a free loopback port in a daemon thread, once it has started;
    returns (server, port). Set ``server.should_exit`` to stop it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, parse_args(argv + ["--log-level", "error"])))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError("uvicorn did not start in 20 s")
        time.sleep(0.02)
    return server, sock.getsockname()[1]


def _busy_app(busy_s: float):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        time.sleep(busy_s)  # blocks the loop on purpose: the server's timers run late
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
    return app


async def _drive(port: int, a) -> dict:
    errors: dict[str, int] = {}
    ok = 0
    end = time.monotonic() + a.duration

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False,
                                 limits=httpx.Limits(max_connections=a.burst_size + a.clients),
                                 timeout=30) as client:
        async def one():
            nonlocal ok
            try:
                await client.get("/")
                ok += 1
            except httpx.HTTPError as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1

        async def steady():
            while time.monotonic() < end:
                await one()
                await asyncio.sleep(5.0 + random.uniform(-a.jitter_s, a.jitter_s))

        async def bursts():
            while time.monotonic() < end:
                await asyncio.gather(*(one() for _ in range(a.burst_size)))
                await asyncio.sleep(5.0 + random.uniform(-a.jitter_s, a.jitter_s))

        await asyncio.gather(bursts(), *(steady() for _ in range(a.clients)))
    return {"ok": ok, "transport_errors": errors, "failed": sum(errors.values())}


def run_one(keep_alive: float, a) -> dict:
    server, port = serve_in_thread(_busy_app(a.busy_ms / 1e3),
                                   ["--timeout-keep-alive", str(keep_alive)])
    try:
        return {"timeout_keep_alive_s": keep_alive, **asyncio.run(_drive(port, a))}
    finally:
        server.should_exit = True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keep-alive", type=float, nargs="+", default=[5.0, 75.0])
    p.add_argument("--duration", type=float, default=40.0, help="seconds per keep-alive")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--burst-size", type=int, default=256)
    p.add_argument("--jitter-s", type=float, default=0.03)
    p.add_argument("--busy-ms", type=float, default=2.0)
    p.add_argument("--out", default="bench/results/keepalive-race-cpu.json")
    a = p.parse_args(argv)
    rows = [run_one(k, a) for k in a.keep_alive]
    for r in rows:
        print(f"keep-alive {r['timeout_keep_alive_s']:g} s: {r['ok']} ok, "
              f"{r['failed']} transport errors {r['transport_errors']}")
    machine = machine_info()
    machine["versions"].update(uvicorn=uvicorn.__version__, httpx=httpx.__version__)
    command = command_line("bench.keepalive", argv) if argv is not None else command_line()
    write_result(a.out, {"bench": "keepalive", "rows": rows, "args": vars(a),
                         "machine": machine, "command": command})

if __name__ == "__main__":
    main()
