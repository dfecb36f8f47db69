"""Soak test of the server (issue 39): mixed traffic for a fixed duration, then end checks.

    python -m bench.soak --model smollm2-135m-instruct --duration 300 --out bench/results/soak-cpu.json
    python -m bench.soak --url http://127.0.0.1:8000 --server-pid PID --duration 60

Without ``--url`` it starts ``python -m jfp8kv.serve`` on a free loopback port (extra server
flags after ``--``) and stops it at the end. Traffic, from ``--clients`` closed-loop clients:
chat and completions, half streamed, random prompt lengths (some sharing one of three long
prefixes, for the prefix cache), ``n`` of 1-2, log-probs, stop strings, sampled and greedy;
10% of streams are dropped by the client after their first chunk, every 20th request (5%) is
malformed (bad JSON, wrong types, unknown model, too many stop strings, a prompt past the
context, a wrong API key when one is set). Every ``--burst-every`` seconds a burst of
``--burst-size`` fixed-shape requests arrives at once (above the queue bound: most of it is
refused with 503).

Reported (JSON under bench/results/ and a summary on stdout): requests by outcome, HTTP
statuses, p50/p99 latency of served requests, and the overload figure: p99 time to first
token of the fixed-shape streamed requests admitted during bursts over the p99 of the same
request sent one at a time to the idle server after the warm-up (``unloaded``), and the
same ratio of whole-request latencies; the target is <= 1.5 on the TTFT ratio. Bursts and
the unloaded baseline are sent from ``--burst-processes`` processes, each with its own event
loop and connections, which time their own requests: one asyncio loop sending hundreds of
requests and reading hundreds of 503s delays the reading of the admitted answers by
seconds (a 40 ms endpoint measured 1.7 s at the median from one loop under a 512-request
burst on a 2-core machine), which the earlier single-loop figure charged to the server.
End checks, each true or false: no 5xx for a client mistake, no 5xx but 503 at all, every
KV page back in the pool (and so every prefix-cache reference released: cached pages all
evictable), greedy answers
of a fixed probe set unchanged from the start, host RSS of the server flat after warm-up
(growth from the first sample after the run's last XLA compile below max(5%, 64 MiB), that
stretch at least the run's second half). Only loopback addresses are contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time

import httpx

from bench.common import RESULTS, ROOT, command_line, nvidia_smi_gpu, write_result

WORDS = ("river stone light north garden quiet paper window cloud seven orange market winter "
         "bridge music forest silver engine letter morning harbor yellow candle mountain").split()
PREFIXES = [" ".join(random.Random(k).choices(WORDS, k=20)) for k in range(3)]
PROBES = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def add(a, b):"]
BURST_BODY = {"prompt": "Burst: tell me about the sea", "max_tokens": 16, "temperature": 0,
              "ignore_eos": True, "stream": True}


async def _timed_stream(client, body: dict, headers: dict) -> tuple[int | str, float | None,
                                                                    float]:
    """One streamed completion: (status or transport error name, seconds to the first
    token chunk (None when none came), seconds to the end)."""
    t, ttft = time.monotonic(), None
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers=headers) as resp:
            async for line in resp.aiter_lines():
                if ttft is None and line.startswith("data: {") and '"choices"' in line:
                    ttft = time.monotonic() - t
            return resp.status_code, ttft, time.monotonic() - t
    except httpx.HTTPError as e:
        return type(e).__name__, ttft, time.monotonic() - t


def burst_worker(url: str, headers: dict, n: int, at: float, timeout: float,
                 sequential: bool = False) -> list[tuple]:
    """Send ``n`` burst requests at wall-clock time ``at`` from this process (its own event
    loop and connections, so that one loop's work on hundreds of sockets does not delay
    the reading of the admitted requests' answers), all at once or one after another
    (``sequential``: the unloaded baseline, measured the same way). Returns (status,
    ttft_s, total_s, start offset from ``at``) per request."""
    async def go():
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits,
                                     trust_env=False) as client:
            await asyncio.sleep(max(0.0, at - time.time()))

            async def one():
                start = time.time() - at
                return (*await _timed_stream(client, BURST_BODY, headers), start)
            if sequential:
                return [await one() for _ in range(n)]
            return await asyncio.gather(*(one() for _ in range(n)))
    return asyncio.run(go())


def start_senders(processes: int):
    """A pool of ``processes`` sender processes (spawned: no copy of this process's event
    loop or sockets), each started before anything is timed."""
    import concurrent.futures
    import multiprocessing

    pool = concurrent.futures.ProcessPoolExecutor(
        processes, mp_context=multiprocessing.get_context("spawn"))
    list(pool.map(int, range(processes)))  # blocks until every process answered
    return pool


def send_burst(pool, processes: int, url: str, headers: dict, n: int, timeout: float,
               sequential: bool = False) -> list:
    """Futures of ``burst_worker`` results: ``n`` requests split evenly over ``processes``
    senders that all start at the same wall-clock moment, or, ``sequential``, one sender
    sending them one after another."""
    p = 1 if sequential else min(processes, n)
    at = time.time() + 0.2  # every sender has its request bodies ready by then
    parts = [n // p + (i < n % p) for i in range(p)]
    return [pool.submit(burst_worker, url, headers, k, at, timeout, sequential)
            for k in parts if k]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def _delta(end: dict, start: dict, key: str) -> float | None:
    if end.get(key) is None or start.get(key) is None:
        return None
    return end[key] - start[key]


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


class Soak:
    def __init__(self, args, url: str, pid: int | None):
        self.args, self.url, self.pid = args, url, pid
        self.rng = random.Random(args.seed)
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.records: list[dict] = []  # kind, status, latency_s, t
        self.rss: list[tuple[float, int, float]] = []  # (s into the run, RSS, XLA compiles)
        self.burst_windows: list[tuple[float, float]] = []
        self.t0 = 0.0
        self.sent = 0  # requests the closed-loop clients have started (malformed included)
        self.pool = None  # burst sender processes (``burst_processes``)

    # -- requests -----------------------------------------------------------------------
    def _prompt(self) -> str:
        k = self.rng.randint(1, self.args.max_prompt_words)
        words = " ".join(self.rng.choices(WORDS, k=k))
        return f"{self.rng.choice(PREFIXES)} {words}" if self.rng.random() < 0.3 else words

    def _body(self) -> tuple[str, dict]:
        r = self.rng
        chat = r.random() < 0.5
        body: dict = {"max_tokens": r.randint(1, self.args.max_tokens),
                      "temperature": r.choice([0, 0, 0.8]), "stream": r.random() < 0.5,
                      "n": r.choice([1, 1, 1, 2])}
        if r.random() < 0.2:
            body["stop"] = r.sample(WORDS, r.randint(1, 3))
        if r.random() < 0.3:
            if chat:
                body.update(logprobs=True, top_logprobs=r.randint(0, 5))
            else:
                body["logprobs"] = r.randint(0, 5)
        if chat:
            body["messages"] = [{"role": "user", "content": self._prompt()}]
            return "/v1/chat/completions", body
        body["prompt"] = self._prompt()
        return "/v1/completions", body

    def _malformed(self) -> tuple[str, bytes | dict, dict]:
        """(path, body, extra headers) of a request the client gets wrong."""
        r, h = self.rng, dict(self.headers)
        choice = r.randrange(7 if self.args.api_key else 6)
        if choice == 0:
            return "/v1/completions", b'{"prompt": "x", "max_tokens": ', h
        if choice == 1:
            return "/v1/completions", {"prompt": "x", "max_tokens": "5"}, h
        if choice == 2:
            return "/v1/chat/completions", {"model": "no-such-model",
                                            "messages": [{"role": "user", "content": "x"}]}, h
        if choice == 3:
            return "/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(40)]}, h
        if choice == 4:
            return "/v1/completions", {"prompt": "word " * 50_000, "max_tokens": 4}, h
        if choice == 5:
            return "/v1/chat/completions", {"messages": []}, h
        return "/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer wrong-key"}

    def _record(self, kind: str, status: int | str, t_start: float, shape: str = "mixed"):
        self.records.append({"kind": kind, "status": status, "shape": shape, "t": t_start,
                             "latency_s": time.monotonic() - t_start})

    async def _send(self, client: httpx.AsyncClient, path: str, body, kind: str,
                    headers: dict | None = None, drop: bool = False, shape: str = "mixed"):
        t = time.monotonic()
        headers = self.headers if headers is None else headers
        try:
            if isinstance(body, bytes):
                resp = await client.post(path, content=body, headers={
                    **headers, "Content-Type": "application/json"})
                return self._record(kind, resp.status_code, t, shape)
            if not body.get("stream"):
                resp = await client.post(path, json=body, headers=headers)
                ok = resp.status_code != 200 or "choices" in resp.json()
                return self._record(kind if ok else "bad_body", resp.status_code, t, shape)
            async with client.stream("POST", path, json=body, headers=headers) as resp:
                async for line in resp.aiter_lines():
                    if drop and line.startswith("data: {"):
                        return self._record("disconnect", resp.status_code, t, shape)
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        return self._record("stream_error", resp.status_code, t, shape)
                return self._record(kind, resp.status_code, t, shape)
        except httpx.HTTPError as e:
            return self._record(kind, type(e).__name__, t, shape)

    async def _client_loop(self, client, end: float):
        while time.monotonic() < end:
            self.sent += 1
            if self.sent % 20 == 2:  # 5%, from the 2nd request on: a short run has them too
                path, body, headers = self._malformed()
                await self._send(client, path, body, "malformed", headers)
                continue
            path, body = self._body()
            drop = body["stream"] and self.rng.random() < 0.1
            await self._send(client, path, body, "request", drop=drop)

    async def _bursts(self, client, end: float):
        """A burst at each ``burst_every`` seconds of the run's clock, none in the last half
        interval. Each starts on time whether or not the one before has drained (a busy
        server had stretched a 30 s run's three bursts to one when each waited for the last)."""
        every, start, bursts = self.args.burst_every, time.monotonic(), []
        at = start + every
        while at + every / 2 <= end:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            bursts.append(asyncio.create_task(self._burst(client)))
            at += every
        await asyncio.gather(*bursts)

    async def _burst(self, client):
        t = time.monotonic()
        for status, ttft, total, _ in await self._from_senders(self.args.burst_size):
            self.records.append({"kind": "burst", "status": status, "shape": "fixed",
                                 "t": t, "latency_s": total, "ttft_s": ttft})
        self.burst_windows.append((t, time.monotonic()))

    async def _from_senders(self, n: int, sequential: bool = False) -> list[tuple]:
        """``n`` burst requests from the sender processes (``send_burst``)."""
        if self.pool is None:
            self.pool = await asyncio.to_thread(start_senders, self.args.burst_processes)
        futs = send_burst(self.pool, self.args.burst_processes, self.url, self.headers, n,
                          self.args.request_timeout, sequential)
        return [r for part in await asyncio.gather(*map(asyncio.wrap_future, futs))
                for r in part]

    async def _sample_rss(self, client, end: float):
        """Each second: the server's RSS and its XLA compile count (/metrics; NaN if absent)."""
        while time.monotonic() < end:
            rss = rss_bytes(self.pid)
            if rss is not None:
                try:
                    compiles = _metric((await client.get("/metrics")).text,
                                       "jfp8kv_xla_compiles_total")
                except httpx.HTTPError:
                    compiles = float("nan")
                self.rss.append((time.monotonic() - self.t0, rss, compiles))
            await asyncio.sleep(1.0)

    # -- phases -------------------------------------------------------------------------
    async def probes(self, client) -> list[str]:
        out = []
        for p in PROBES:
            r = await client.post("/v1/completions", headers=self.headers, json={
                "prompt": p, "max_tokens": 12, "temperature": 0})
            ok = r.status_code == 200
            out.append(r.json()["choices"][0]["text"] if ok else f"<{r.status_code}>")
        return out

    async def cover_variants(self, client) -> None:
        """Before the random warm-up: each executable variant the traffic reaches for sure,
        log-probs off and on x the shortest and longest prompt x one request alone (one-row
        batches) and ``burst_size`` at once (the widest batches), so that first uses compile
        here rather than in the measured run."""
        n = self.args.max_prompt_words
        longest = f"{max(PREFIXES, key=len)} {' '.join((WORDS * (n // len(WORDS) + 1))[:n])}"
        for logprobs in (False, True):
            for prompt in (WORDS[0], longest):
                body = {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                        **({"logprobs": 1} if logprobs else {})}
                await self._send(client, "/v1/completions", body, "request")
                await asyncio.gather(*(self._send(client, "/v1/completions", body, "request")
                                       for _ in range(self.args.burst_size)))

    async def unloaded(self) -> list[tuple]:
        """The burst's request alone on the idle server, from a sender process: (status,
        ttft_s, total_s, start) each."""
        return [r for r in await self._from_senders(self.args.unloaded_requests,
                                                    sequential=True) if r[0] == 200]

    async def idle_state(self, client, limit_s: float = 120.0) -> dict:
        end, m = time.monotonic() + limit_s, ""
        while time.monotonic() < end:
            m = (await client.get("/metrics")).text
            busy = [_metric(m, k) for k in ("jfp8kv_kv_cache_pages_used",
                                            "jfp8kv_num_requests_running", "jfp8kv_queue_length")]
            if busy == [0, 0, 0]:
                break
            await asyncio.sleep(0.5)
        keys = ("kv_cache_pages_used", "kv_cache_pages_total", "num_requests_running",
                "queue_length", "prefix_cache_pages", "preemptions_total",
                "prefix_cache_hit_rate", "requests_timed_out_total", "xla_compiles_total")
        state = {k: _metric(m, "jfp8kv_" + k) for k in keys}
        state["rejected_overloaded"] = _metric(
            m.replace('{reason="server_overloaded"}', ""), "jfp8kv_requests_rejected_total")
        return state

    async def run(self) -> dict:
        a = self.args
        limits = httpx.Limits(max_connections=None)  # bursts may overlap: no client-side queue
        async with httpx.AsyncClient(base_url=self.url, timeout=a.request_timeout,
                                     limits=limits, trust_env=False) as client:
            probes_before = await self.probes(client)
            if a.warmup > 0:  # the same traffic, unrecorded: compiles the shapes it uses
                await self.cover_variants(client)
                end = time.monotonic() + a.warmup
                await asyncio.gather(self._bursts(client, end),
                                     *(self._client_loop(client, end) for _ in range(a.clients)))
                self.records, self.burst_windows = [], []
            self.start_state = await self.idle_state(client)
            unloaded = await self.unloaded()  # alone, on an idle server, shape compiled
            self.t0 = time.monotonic()
            end = self.t0 + a.duration
            await asyncio.gather(self._sample_rss(client, end), self._bursts(client, end),
                                 *(self._client_loop(client, end) for _ in range(a.clients)))
            soak_s = time.monotonic() - self.t0
            idle = await self.idle_state(client)
            probes_after = await self.probes(client)
        if self.pool is not None:
            self.pool.shutdown()
        return self.report(probes_before, probes_after, unloaded, idle, soak_s)

    # -- report -------------------------------------------------------------------------
    def report(self, before, after, unloaded, idle, soak_s) -> dict:
        recs = self.records
        by_status: dict[str, int] = {}
        for r in recs:
            by_status[str(r["status"])] = by_status.get(str(r["status"]), 0) + 1
        served = [r for r in recs if r["kind"] in ("request", "burst") and r["status"] == 200]
        burst = [r for r in recs if r["shape"] == "fixed" and r["status"] == 200]
        burst_ok = [r["latency_s"] for r in burst]
        burst_ttft = [r["ttft_s"] for r in burst if r.get("ttft_s") is not None]
        unloaded_ttft = [u[1] for u in unloaded if u[1] is not None]
        unloaded = [u[2] for u in unloaded]
        t99, ut99 = percentile(burst_ttft, 99), percentile(unloaded_ttft, 99)
        mistakes = [r for r in recs if r["kind"] == "malformed"]
        five = [r for r in recs if isinstance(r["status"], int) and r["status"] >= 500]
        lat = [r["latency_s"] for r in served]
        u99, b99 = percentile(unloaded, 99), percentile(burst_ok, 99)
        checks = {
            "no_5xx_for_client_mistakes": all(isinstance(r["status"], int) and 400 <= r["status"]
                                              < 500 for r in mistakes),
            "no_5xx_but_503": all(r["status"] == 503 for r in five),
            "no_transport_errors": all(isinstance(r["status"], int) for r in recs),
            "pages_back_in_pool": idle["kv_cache_pages_used"] == 0
            and idle["num_requests_running"] == 0 and idle["queue_length"] == 0,
            "prefix_cache_refs_released": idle["kv_cache_pages_used"] == 0
            and idle["prefix_cache_pages"] <= idle["kv_cache_pages_total"],
            "greedy_probes_unchanged": before == after,
            "rss_flat_after_warmup": self._rss_flat(),
        }
        kinds: dict[str, int] = {}
        for r in recs:
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
        rss = [s for _, s, _ in self.rss]
        return {
            "duration_s": round(soak_s, 1), "requests_total": len(recs),
            "requests_served": len(served), "by_kind": kinds, "by_status": by_status,
            "latency_s": {"p50": percentile(lat, 50), "p99": percentile(lat, 99)},
            "overload": {"burst_size": self.args.burst_size, "bursts": len(self.burst_windows),
                         "burst_admitted": len(burst_ok),
                         "burst_rejected_503": sum(1 for r in recs if r["shape"] == "fixed"
                                                   and r["status"] == 503),
                         "unloaded_p50_s": percentile(unloaded, 50), "unloaded_p99_s": u99,
                         "burst_admitted_p50_s": percentile(burst_ok, 50),
                         "burst_admitted_p99_s": b99,
                         "p99_ratio": (b99 / u99) if u99 and b99 else None,
                         "unloaded_ttft_p99_s": ut99, "burst_admitted_ttft_p50_s":
                         percentile(burst_ttft, 50), "burst_admitted_ttft_p99_s": t99,
                         "ttft_p99_ratio": (t99 / ut99) if ut99 and t99 else None,
                         "target": 1.5, "target_on": "ttft_p99_ratio",
                         "senders": f"{self.args.burst_processes} processes, streamed "
                                    "requests, latencies measured in the senders"},
            "idle_metrics": idle, "probes_before": before, "probes_after": after,
            # XLA compiles during the measured run (each adds an executable to the RSS)
            "compiles_in_run": _delta(idle, getattr(self, "start_state", {}),
                                      "xla_compiles_total"),
            "rss_mib": {"first": rss[0] / 2**20 if rss else None,
                        "mid": rss[len(rss) // 2] / 2**20 if rss else None,
                        "last": rss[-1] / 2**20 if rss else None, "samples": len(rss),
                        "deciles": [round(rss[min(len(rss) - 1, i * len(rss) // 10)] / 2**20)
                                    for i in range(11)] if rss else None,
                        "flat_from_s": self._flat_from()},
            "checks": checks, "passed": all(checks.values()),
        }

    def _flat_start(self) -> int | None:
        """Index of the first RSS sample after the run's last XLA compile (a first use of a
        variant the warm-up missed: each executable adds to the RSS once, which is not a
        leak); 0 without a compile counter, None without samples."""
        if not self.rss:
            return None
        last = self.rss[-1][2]
        return 0 if math.isnan(last) else next(i for i, (_, _, c) in enumerate(self.rss)
                                               if c == last)

    def _flat_from(self) -> float | None:
        i = self._flat_start()
        return None if i is None else self.rss[i][0]

    def _rss_flat(self) -> bool | None:
        """RSS growth from the first sample after the run's last compile to the end below
        max(5%, 64 MiB), that stretch covering at least the run's second half (compiles
        later than that: False, too short to tell); None without samples (no pid)."""
        if len(self.rss) < 2:
            return None
        (t0, first, _), (t_end, last, _) = self.rss[self._flat_start()], self.rss[-1]
        return t0 <= t_end / 2 and last - first <= max(0.05 * first, 64 * 2**20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, server_args: list[str]) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    log_path = os.path.join(args.log_dir, f"soak-server-{port}.log")
    cmd = [sys.executable, "-m", "jfp8kv.serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", *server_args]
    env = dict(os.environ)
    if args.api_key:
        env["JFP8KV_API_KEY"] = args.api_key
    if getattr(args, "startup_profile", None):  # jfp8kv.engine.startup_profile's JSON
        env["JFP8KV_STARTUP_PROFILE"] = os.path.abspath(args.startup_profile)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + args.startup_timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} (log: {log_path})")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url, " ".join(cmd[1:])
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server not healthy after {args.startup_timeout} s (log: {log_path})")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--server-pid", type=int, help="its pid, for the RSS check (with --url)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of mixed traffic")
    p.add_argument("--warmup", type=float, default=30.0,
                   help="seconds of the same traffic before, not recorded (RSS baseline after)")
    p.add_argument("--clients", type=int, default=6, help="closed-loop clients")
    p.add_argument("--burst-every", type=float, default=20.0)
    p.add_argument("--burst-size", type=int, default=64,
                   help="requests per burst; make it ~4x what the server admits "
                        "(max_num_seqs + max-queued-requests)")
    p.add_argument("--burst-processes", type=int, default=min(4, os.cpu_count() or 1),
                   help="processes that send each burst (and the unloaded baseline), each "
                        "with its own event loop and connections")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-prompt-words", type=int, default=30)
    p.add_argument("--unloaded-requests", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=300.0, help="client side")
    p.add_argument("--api-key", default=None, help="started server: sets its key; --url: sent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/soak.json)")
    p.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="after --: flags for the started server")
    args = p.parse_args(argv)
    if args.server_args and args.server_args[0] == "--":
        args.server_args = args.server_args[1:]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    proc, url, server_cmd, pid = None, args.url, None, args.server_pid
    if url is None:
        proc, url, server_cmd = start_server(args, args.server_args)
        pid = proc.pid
    try:
        result = asyncio.run(Soak(args, url, pid).run())
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    command = command_line("bench.soak", argv)
    if args.api_key:  # the key stays out of the record
        command = command.replace(args.api_key, "<key>")
    doc = {"command": command, "server_command": server_cmd,
           "machine": {"host": platform.node(), "cpus": os.cpu_count(), "gpu": nvidia_smi_gpu(),
                       "python": platform.python_version()},
           "args": {k: v for k, v in vars(args).items() if k != "api_key"}, **result}
    out = args.out or os.path.join(RESULTS, "soak.json")
    write_result(out, doc)
    o = result["overload"]
    print(f"soak {result['duration_s']} s: {result['requests_total']} requests, "
          f"{result['requests_served']} served, statuses {result['by_status']}")
    print(f"latency p50 {result['latency_s']['p50']} s p99 {result['latency_s']['p99']} s; "
          f"overload p99 TTFT ratio {o['ttft_p99_ratio']}, total {o['p99_ratio']} "
          f"(admitted {o['burst_admitted']}, "
          f"refused {o['burst_rejected_503']})")
    print("checks:", json.dumps(result["checks"]), "->", "PASS" if result["passed"] else "FAIL")
    print("wrote", out)
    return doc


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
