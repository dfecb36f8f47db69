"""What a burst costs the HTTP path alone: bench.soak's overload figure without an engine.

A stand-in server (FastAPI + uvicorn, as ``jfp8kv.serve``) answers ``/v1/completions`` with
16 streamed chunks 2.5 ms apart (~40 ms, an unloaded small-model request) to at most
``--admit`` requests at once and 503 to the rest. A burst of ``--burst`` requests is sent
(a) from one asyncio loop, as bench.soak did, and (b) from ``--processes`` sender processes
(``bench.soak.burst_worker``, as it does now); each against the same requests sent one at a
time (the unloaded baseline, from the same kind of sender). Reported: p50/p99 time to first
chunk and to the end for the admitted requests, and p99 over unloaded p99, per sender. The
server does nothing but wait, so whatever the ratio exceeds 1 by is the HTTP stack's and the
sender's work under the burst, on this machine.

    python -m bench.burst_http --out bench/results/burst-http-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time

import httpx

from bench.common import command_line, write_result
from bench.soak import BURST_BODY, _timed_stream, free_port, percentile, send_burst, start_senders

APP = textwrap.dedent('''
    import asyncio, json
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    app = FastAPI()
    running = [0]
    ADMIT = int(__import__("os").environ["ADMIT"])

    @app.post("/v1/completions")
    async def completions(body: dict):
        if running[0] >= ADMIT:
            return JSONResponse({"error": {"message": "overloaded", "type": "server_overloaded"}},
                                status_code=503, headers={"Retry-After": "1"})
        running[0] += 1

        async def chunks():
            try:
                for i in range(16):
                    await asyncio.sleep(0.0025)
                    chunk = {"choices": [{"text": "x", "index": 0}]}
                    yield "data: " + json.dumps(chunk) + "\\n\\n"
                yield "data: [DONE]\\n\\n"
            finally:
                running[0] -= 1
        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {}
''')


def one_loop(url: str, n: int, sequential: bool) -> list[tuple]:
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False,
                                     limits=httpx.Limits(max_connections=None)) as c:
            if sequential:
                return [await _timed_stream(c, BURST_BODY, {}) for _ in range(n)]
            return await asyncio.gather(*(_timed_stream(c, BURST_BODY, {}) for _ in range(n)))
    return asyncio.run(go())


def processes(url: str, n: int, p: int, sequential: bool) -> list[tuple]:
    pool = start_senders(p)
    try:
        return [r[:3] for f in send_burst(pool, p, url, {}, n, 120, sequential)
                for r in f.result()]
    finally:
        pool.shutdown()


def stats(unloaded, burst) -> dict:
    ok = [r for r in burst if r[0] == 200]
    u_ttft, u_tot = [r[1] for r in unloaded], [r[2] for r in unloaded]
    b_ttft, b_tot = [r[1] for r in ok if r[1] is not None], [r[2] for r in ok]
    return {"admitted": len(ok), "rejected_503": sum(r[0] == 503 for r in burst),
            "unloaded_ttft_p99_s": percentile(u_ttft, 99),
            "unloaded_total_p99_s": percentile(u_tot, 99),
            "burst_ttft_p50_s": percentile(b_ttft, 50), "burst_ttft_p99_s": percentile(b_ttft, 99),
            "burst_total_p50_s": percentile(b_tot, 50), "burst_total_p99_s": percentile(b_tot, 99),
            "ttft_p99_ratio": percentile(b_ttft, 99) / percentile(u_ttft, 99),
            "total_p99_ratio": percentile(b_tot, 99) / percentile(u_tot, 99)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.burst_http", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--burst", type=int, default=512)
    p.add_argument("--admit", type=int, default=64)
    p.add_argument("--processes", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--unloaded", type=int, default=8)
    p.add_argument("--uvicorn-args", default="",
                   help="extra uvicorn flags for the stand-in (e.g. '--loop uvloop --http "
                        "httptools')")
    p.add_argument("--out", default="bench/results/burst-http-cpu.json")
    args = p.parse_args(argv)
    port = free_port()
    app = tempfile.NamedTemporaryFile("w", suffix=".py", prefix="burst_app_", delete=False)
    app.write(APP)
    app.close()
    mod = os.path.basename(app.name)[:-3]
    srv = subprocess.Popen([sys.executable, "-m", "uvicorn", f"{mod}:app", "--port", str(port),
                            "--log-level", "warning", *args.uvicorn_args.split()],
                           cwd=os.path.dirname(app.name),
                           env=dict(os.environ, ADMIT=str(args.admit)))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(url + "/health", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        one_loop(url, 4, True)  # connections and imports warm
        runs = {
            "one_loop": stats(one_loop(url, args.unloaded, True),
                              one_loop(url, args.burst, False)),
            f"{args.processes}_processes": stats(processes(url, args.unloaded, 1, True),
                                                 processes(url, args.burst, args.processes,
                                                           False)),
        }
    finally:
        srv.terminate()
        srv.wait(10)
        os.unlink(app.name)
    doc = {"command": command_line("bench.burst_http", argv),
           "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                       "python": platform.python_version(),
                       "loadavg": open("/proc/loadavg").read().split()[:3]},
           "uvicorn_args": args.uvicorn_args, "burst": args.burst, "admit": args.admit,
           "runs": runs}
    write_result(args.out, doc)
    for k, r in runs.items():
        print(f"{k}: admitted {r['admitted']}, TTFT p99 {r['burst_ttft_p99_s']:.3f} s "
              f"(unloaded {r['unloaded_ttft_p99_s']:.3f}) ratio {r['ttft_p99_ratio']:.1f}; "
              f"total p99 ratio {r['total_p99_ratio']:.1f}")
    return doc


if __name__ == "__main__":
    main()
