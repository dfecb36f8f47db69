"""Serving benchmark matrix on the GPU: real server processes, bf16 vs fp8 KV.

For each model shape, starts ``python -m jfp8kv.serve`` once per KV dtype (random weights of the
real architecture), runs ``bench/serving/client.py`` for each workload, stops the servers, and writes
one JSON: ``{"machine", "versions", "command", "runs", "floor", "peer", "skipped", "errors"}``.
The decode-floor records (``bench/decode_floor.py``'s output) and the outside peer
(``bench/peer_hf.py``'s output) are copied in when ``--floor`` / ``--peer`` are given.

    python -m bench.serving.matrix --shapes random:qwen3-8b --kv bfloat16,fp8_e4m3 \\
        --workloads 8192:1024:32:32:32,8192:128:1:4:1 --parallel-servers --mem-fraction 0.47 \\
        --kv-cache-memory 46000000000 --deadline-s 380 --out /tmp/serving.json

Workloads: a comma list of ``IN:OUT:CONC:N[:WARM_N[:WARM_OUT]]`` (input tokens, output tokens,
``--max-concurrency``, ``--num-prompts``). ``IN`` written ``LxG+Q`` is a shared-prefix
workload (``bench/serving/client.py --shared-prefix-groups G --shared-prefix-len L
--random-input-len Q``): G groups of requests sharing an L-token prefix, each with its own
Q-token question (input length L + Q); its warm-up uses other prefixes (more warm-up
requests than groups, so that prefills after a cache hit compile there too). Each (workload, KV dtype) is two invocations of
``bench/serving/client.py``: a warm-up of WARM_N requests sent at once with IN input and WARM_OUT
output tokens (defaults: CONC and min(OUT, 128); 0 skips it), which compiles the shape buckets
the timed run will use, then the timed run (``--warmup-requests 0``). The server runs with
``--warmup off`` by default, so buckets compile on first use: order the workloads so that
later ones reuse earlier ones' buckets, and give the first workload of a shape family a warm-up.

Every run record carries the ``bench/serving/client.py`` metrics (SGLang ``bench_serving`` names:
``median_ttft_ms``, ``median_itl_ms``, ``median_tpot_ms``, ``output_throughput``, ...) and:
``model_shape``, ``kv_cache_dtype``, ``kv_scale_mode``, ``input_len``, ``output_len``,
``max_concurrency``, ``num_prompts``, ``max_num_batched_tokens``, ``kv_cache_memory``,
``server_startup_s``, ``enable_prefix_caching`` (None: the server's default, on),
``shared_prefix_groups``, ``shared_prefix_len`` (0: no shared prefix); ``warmup`` (requests, output_len, duration_s, compiles); and what the
server did during the timed window, from its log and ``/metrics``: ``compiles_in_run`` and
``compile_s_in_run`` (XLA compilations of the engine's steps, counted from ``JAX_LOG_COMPILES``
lines: a non-zero count means the timed run paid a compile stall) and
``preemptions_in_run``, and the server's prefix-cache counters over the timed run,
``prefix_cache_queries_in_run``, ``prefix_cache_hits_in_run``, ``prefix_cache_evictions_in_run``.

``--prefix-caching on,off`` serves each KV dtype twice, with ``--enable-prefix-caching`` and
``--no-enable-prefix-caching`` (default: one server per dtype with the server's default).
The shared-prefix run of issue 18 (bf16 vs fp8, caching on and off, at one fixed pool)::

    python -m bench.serving.matrix --shapes random:qwen3-8b --kv bfloat16,fp8_e4m3 \\
        --prefix-caching on,off --workloads 4096x32+256:256:64:512:64:16,4096x4+256:16:1:32:8:16 \\
        --kv-cache-memory 16000000000 --max-num-batched-tokens 8192 --run-timeout 300 \\
        --out /tmp/serving-prefix.json

ITL is counted per streamed chunk, as SGLang's ``bench_serving`` does for OpenAI-compatible
endpoints; on the GPU the engine decodes 8 steps per host round trip and streams each as one
chunk, so ITL ~ 8 x TPOT (``mean_tokens_per_chunk`` in each record). TPOT is per token.

Budget: ``--deadline-s`` bounds the whole script (start-up included). Each invocation's
timeout is min(``--run-timeout``, time left); a run that cannot start with ``--min-run-s`` left
is recorded in ``skipped``. The JSON is rewritten after every run, so a call cut short keeps
what it measured. SIGTERM/SIGINT stop the servers and save before exiting.

``--parallel-servers`` starts the servers of one shape (one per KV dtype) at the same time,
each limited to ``--mem-fraction`` of the GPU, and runs every workload on each dtype back to
back, so start-up overlaps and a cut-short call still has bf16/fp8 pairs. Only one server
works at a time; the other is idle (its engine thread sleeps). Server PIDs are written to
``<log-dir>/server.pids`` so a wrapper can stop them if this script is killed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench import internals
from bench.common import ROOT, nvidia_smi_gpu

COMPILE_RE = re.compile(r"Finished XLA compilation of jit\((_prefill|_decode|_nll)\) in "
                        r"([0-9.eE+-]+) ?s")
WARM_OUT_CAP = 128


class Deadline(Exception):
    pass


def parse_workloads(text: str) -> list[dict]:
    out = []
    for item in text.split(","):
        head, _, rest = item.strip().partition(":")
        groups = plen = 0
        m = re.fullmatch(r"(\d+)x(\d+)\+(\d+)", head)
        try:
            if m:  # LxG+Q: G groups sharing an L-token prefix, Q-token questions
                plen, groups, question = (int(x) for x in m.groups())
                head = str(plen + question)
            f = [int(x) for x in [head, *rest.split(":")]]
        except ValueError:
            f = []
        if len(f) not in (4, 5, 6) or (m and not (plen > 0 and groups > 0 and question > 0)):
            raise ValueError(f"workload {item!r}: want IN:OUT:CONC:N[:WARM_N[:WARM_OUT]], "
                             f"IN an integer or LxG+Q (shared prefix)")
        inp, outl, conc, n = f[:4]
        warm_n = f[4] if len(f) > 4 else conc
        warm_out = f[5] if len(f) > 5 else min(outl, WARM_OUT_CAP)
        out.append(dict(input_len=inp, output_len=outl, max_concurrency=conc, num_prompts=n,
                        warm_n=warm_n, warm_out=warm_out, shared_prefix_groups=groups,
                        shared_prefix_len=plen))
    return out


def parse_caching(text: str | None) -> list[bool | None]:
    """``--prefix-caching``: None (the server's default) or a list of on/off."""
    if not text:
        return [None]
    values = {"on": True, "off": False}
    out = [values.get(v.strip()) for v in text.split(",")]
    if None in out:
        raise ValueError(f"--prefix-caching {text!r}: want a comma list of on, off")
    return out


def machine_record() -> tuple[dict, dict]:
    """Device and versions without initialising a JAX backend in this process (the servers
    need the GPU memory)."""
    device = nvidia_smi_gpu()
    versions = {}
    for pkg in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "numpy", "fastapi",
                "uvicorn", "aiohttp"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    name = device.split(",")[0].strip() if device else "cpu"
    machine = {"device": name, "platform": "gpu" if device else "cpu", "gpu": device,
               "host": platform.node(), "python": platform.python_version(),
               "versions": {k: versions.get(k, "?") for k in ("jax", "jaxlib")}}
    return machine, versions


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


class Server:
    def __init__(self, shape: str, kv: str, port: int, args, max_len: int, max_seqs: int,
                 caching: bool | None = None):
        self.shape, self.kv, self.port, self.args = shape, kv, port, args
        self.caching = caching
        self.mode = None
        cmd = [sys.executable, "-m", "jfp8kv.serve", "--model", shape, "--dtype", args.dtype,
               "--kv-cache-dtype", kv, "--max-model-len", str(max_len), "--max-num-seqs",
               str(max_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--port", str(port), "--warmup", args.warmup, "--log-level", "warning"]
        if args.kv_cache_memory:
            cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
        if kv.startswith("fp8"):
            self.mode = args.kv_scale_mode or internals.default_fp8_scale_mode()
            cmd += ["--kv-scale-mode", self.mode]
        if caching is not None:
            cmd.append("--enable-prefix-caching" if caching else "--no-enable-prefix-caching")
        env = dict(os.environ, JAX_LOG_COMPILES="1", PYTHONUNBUFFERED="1")
        if args.mem_fraction:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)
        name = os.path.basename(shape.split(":")[-1])
        tag = "" if caching is None else ("-cache" if caching else "-nocache")
        self.log_path = os.path.join(args.log_dir, f"server-{name}-{kv}{tag}.log")
        self.log = open(self.log_path, "w")
        self.cmd = cmd
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        self.startup_s = None
        with open(os.path.join(args.log_dir, "server.pids"), "a") as f:
            f.write(f"{self.proc.pid}\n")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} "
                                   f"(log: {self.log_path})")
            try:
                http_get(self.url + "/health", 2)  # 200, else HTTPError (an OSError)
                self.startup_s = time.monotonic() - self.t0
                return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server on port {self.port} not healthy after {timeout_s:.0f} s")

    def log_offset(self) -> int:
        self.log.flush()
        return os.path.getsize(self.log_path)

    def compiles_since(self, offset: int) -> tuple[int, float, list]:
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            hits = COMPILE_RE.findall(f.read())
        return len(hits), sum(float(s) for _, s in hits), [f"{n}:{float(s):.1f}" for n, s in hits]

    def metrics(self) -> str:
        try:
            return http_get(self.url + "/metrics")
        except OSError:
            return ""

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is running or waiting (a killed client's requests are
        aborted by the server on disconnect)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            text = self.metrics()
            if (metric(text, "jfp8kv_num_requests_running") or 0) == 0 and \
                    (metric(text, "jfp8kv_queue_length") or 0) == 0:
                return True
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def bench(server: Server, w: dict, warm: bool, timeout: float, args) -> dict:
    n = w["warm_n"] if warm else w["num_prompts"]
    out = w["warm_out"] if warm else w["output_len"]
    conc = w["warm_n"] if warm else w["max_concurrency"]
    fd, path = tempfile.mkstemp(suffix=".jsonl", dir=args.log_dir if warm else None)
    os.close(fd)
    cmd = [sys.executable, "-m", "bench.serving", "--port",
           str(server.port), "--num-prompts", str(n), "--random-input-len", str(w["input_len"]),
           "--random-output-len", str(out), "--max-concurrency", str(conc), "--ignore-eos",
           "--warmup-requests", "0", "--disable-tqdm", "--output-file", path,
           "--seed", str(args.seed + (1000 if warm else 0)),
           "--token-id-range", *map(str, args.token_id_range)]
    if w["shared_prefix_groups"]:  # input_len = prefix + question
        cmd[cmd.index("--random-input-len") + 1] = str(w["input_len"] - w["shared_prefix_len"])
        cmd += ["--shared-prefix-groups", str(w["shared_prefix_groups"]),
                "--shared-prefix-len", str(w["shared_prefix_len"])]
    logf = os.path.join(args.log_dir, "bench-client.log")
    with open(logf, "a") as lf:
        lf.write(f"\n### {server.kv} caching={server.caching} "
                 f"{'warm-up' if warm else 'timed'} {w}\n")
        lf.flush()
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=timeout, stdout=lf,
                       stderr=subprocess.STDOUT)
    with open(path) as f:
        rec = json.loads(f.readlines()[-1])
    os.unlink(path)
    return rec


def run_one(server: Server, w: dict, args, t_end: float) -> dict:
    """Warm-up then timed run of one workload on one server; returns the run record."""
    def left() -> float:
        return t_end - time.monotonic()

    if left() < args.min_run_s:
        raise Deadline(f"{left():.0f} s left")
    if not server.wait_idle(min(30.0, max(1.0, left() - args.min_run_s))):
        raise RuntimeError("server still busy before the run")
    warm_info = {"requests": w["warm_n"], "output_len": w["warm_out"]}
    if w["warm_n"] > 0:
        off = server.log_offset()
        t0 = time.monotonic()
        wrec = bench(server, w, True, min(args.run_timeout, left()), args)
        n, s, which = server.compiles_since(off)
        warm_info.update(duration_s=time.monotonic() - t0, compiles=n, compile_s=s,
                         compiled=which, completed=wrec["completed"], failed=wrec["failed"])
        if left() < args.min_run_s:
            raise Deadline(f"after warm-up, {left():.0f} s left")
    before = server.metrics()
    off = server.log_offset()
    rec = bench(server, w, False, min(args.run_timeout, left()), args)
    n, s, which = server.compiles_since(off)
    after = server.metrics()
    def delta(name):
        v = [metric(t, name) for t in (before, after)]
        return (v[1] - v[0]) if None not in v else None

    rec.update(model_shape=server.shape, kv_cache_dtype=server.kv, kv_scale_mode=server.mode,
               input_len=w["input_len"], output_len=w["output_len"],
               max_concurrency=w["max_concurrency"], num_prompts=w["num_prompts"],
               max_num_batched_tokens=args.max_num_batched_tokens,
               kv_cache_memory=args.kv_cache_memory, server_startup_s=server.startup_s,
               server_command=" ".join(["python", *server.cmd[1:]]), warmup=warm_info,
               compiles_in_run=n, compile_s_in_run=s, compiled_in_run=which,
               preemptions_in_run=delta("jfp8kv_preemptions"),
               enable_prefix_caching=server.caching,
               shared_prefix_groups=w["shared_prefix_groups"],
               shared_prefix_len=w["shared_prefix_len"],
               prefix_cache_queries_in_run=delta("jfp8kv_prefix_cache_queries"),
               prefix_cache_hits_in_run=delta("jfp8kv_prefix_cache_hits"),
               prefix_cache_evictions_in_run=delta("jfp8kv_prefix_cache_evictions"))
    return rec


def _hits(rec: dict) -> str:
    """The run's prefix-cache line: hit rate, and median TTFT of hits vs cold requests."""
    if not rec.get("total_cached_tokens"):
        return ""
    hit, cold = rec.get("median_ttft_hit_ms"), rec.get("median_ttft_cold_ms")
    ttft = f" (TTFT hit {hit:.0f} / cold {cold:.0f} ms)" if hit and cold else ""
    return f"prefix hits {rec['prefix_cache_hit_rate']:.0%}{ttft}, "


def _failed(rec: dict) -> str:
    """Failed requests and the first error, so a run of rejected requests does not read as
    an instant success (its metrics are zeros)."""
    if not rec.get("failed"):
        return ""
    first = (rec.get("errors") or ["?"])[0]
    return f"FAILED {rec['failed']} of {rec['failed'] + rec['completed']} ({first[:160]}), "


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="random:qwen3-8b")
    p.add_argument("--kv", default="bfloat16,fp8_e4m3")
    p.add_argument("--workloads", default="8192:1024:32:32:32,8192:128:1:4:1,8192:128:8:8:4,"
                   "32768:128:1:4:0,512:128:1:4:1,2048:1024:64:64,512:128:64:64,"
                   "8192:128:32:32:0", help="comma list of IN:OUT:CONC:N[:WARM_N[:WARM_OUT]]")
    p.add_argument("--prefix-caching", default=None,
                   help="on,off: serve each KV dtype with and without prefix caching "
                        "(default: the server's default, on)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-scale-mode", default=None, help="fp8 mode (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--token-id-range", type=int, nargs=2, default=(1000, 30000))
    p.add_argument("--warmup", default="off", choices=("on", "off", "auto"),
                   help="the server's start-up compilation (off: buckets compile on first use)")
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--mem-fraction", type=lambda v: float(v) if v else None, default=None,
                   help="XLA_PYTHON_CLIENT_MEM_FRACTION of each server")
    p.add_argument("--parallel-servers", action="store_true",
                   help="start one server per KV dtype at once; run each workload on each")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--run-timeout", type=float, default=120, help="per bench invocation, s")
    p.add_argument("--deadline-s", type=float, default=None, help="budget of the whole script")
    p.add_argument("--min-run-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--floor", default=None, help="decode_floor.py output to include")
    p.add_argument("--peer", default=None, help="peer_hf.py output to include")
    p.add_argument("--log-dir", default=tempfile.gettempdir())
    p.add_argument("--out", default="bench/results/serving-h200.json")
    args = p.parse_args(argv)
    t_start = time.monotonic()
    t_end = t_start + (args.deadline_s or 1e9)
    os.makedirs(args.log_dir, exist_ok=True)
    workloads = parse_workloads(args.workloads)
    kvs = [(kv, c) for kv in args.kv.split(",") for c in parse_caching(args.prefix_caching)]
    machine, versions = machine_record()
    doc = {"machine": machine, "versions": versions,
           "command": " ".join(["python", *sys.argv]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "workloads": args.workloads, "runs": [], "floor": [], "peer": [], "skipped": [],
           "errors": [], "servers": []}

    def save():
        for key, path in (("floor", args.floor), ("peer", args.peer)):
            if path and os.path.exists(path):
                with open(path) as f:
                    src = json.load(f)
                doc[key] = src.get(key, [])
                if key == "peer":
                    doc["versions"].update(src.get("versions", {}))
        doc["elapsed_s"] = time.monotonic() - t_start
        from bench.common import write_result

        write_result(args.out, doc)

    servers: list[Server] = []

    def on_signal(sig, frame):
        raise KeyboardInterrupt(f"signal {sig}")

    signal.signal(signal.SIGTERM, on_signal)

    def stop_all():
        for s in servers:
            try:
                s.stop()
            except Exception as e:  # noqa: BLE001
                doc["errors"].append(f"stopping {s.kv}: {type(e).__name__}: {e}")
        servers.clear()

    def start(shape, kv_list, port):
        max_len = max(w["input_len"] + max(w["output_len"], w["warm_out"]) for w in workloads) + 64
        max_seqs = max(max(w["max_concurrency"], w["warm_n"]) for w in workloads)
        new = [Server(shape, kv, port + i, args, max_len, max_seqs, caching)
               for i, (kv, caching) in enumerate(kv_list)]
        up = []
        for s in new:
            servers.append(s)
            try:
                s.wait_healthy(min(args.startup_timeout, max(1.0, t_end - time.monotonic())))
                print(f"[{shape} {s.kv}] server up in {s.startup_s:.0f} s", flush=True)
                doc["servers"].append({"model_shape": shape, "kv_cache_dtype": s.kv,
                                       "kv_scale_mode": s.mode, "startup_s": s.startup_s,
                                       "enable_prefix_caching": s.caching,
                                       "command": " ".join(["python", *s.cmd[1:]])})
                up.append(s)
            except Exception as e:  # noqa: BLE001
                doc["errors"].append(f"{shape} {s.kv} start: {type(e).__name__}: {e}")
                print(doc["errors"][-1], flush=True)
        save()
        return up

    def one(server, w):
        cache = "" if server.caching is None else f" caching={'on' if server.caching else 'off'}"
        shared = (f" shared={w['shared_prefix_len']}x{w['shared_prefix_groups']}"
                  if w["shared_prefix_groups"] else "")
        tag = (f"[{server.shape} {server.kv}{cache}] in={w['input_len']}{shared} "
               f"out={w['output_len']} conc={w['max_concurrency']} n={w['num_prompts']}")
        try:
            rec = run_one(server, w, args, t_end)
        except Deadline as e:
            doc["skipped"].append(f"{tag}: deadline ({e})")
            print(doc["skipped"][-1], flush=True)
            return
        except Exception as e:  # noqa: BLE001  keep what was measured; record what failed
            doc["errors"].append(f"{tag}: {type(e).__name__}: {e}")
            print(doc["errors"][-1], flush=True)
            save()
            return
        doc["runs"].append(rec)
        wu = rec["warmup"]
        print(f"{tag}: TTFT {rec['median_ttft_ms']:.0f} ms, ITL {rec['median_itl_ms']:.1f} ms, "
              f"TPOT {rec['median_tpot_ms']:.2f} ms, {rec['output_throughput']:.0f} tok/s, "
              f"{_hits(rec)}{_failed(rec)}"
              f"{rec['duration']:.1f} s; warm-up {wu.get('duration_s', 0):.0f} s with "
              f"{wu.get('compiles', 0)} compiles ({wu.get('compile_s', 0):.0f} s); "
              f"compiles in run {rec['compiles_in_run']}, preemptions "
              f"{rec['preemptions_in_run']}; t={time.monotonic() - t_start:.0f} s", flush=True)
        save()

    port = 8321
    try:
        for shape in args.shapes.split(","):
            if args.parallel_servers:
                up = start(shape, kvs, port)
                port += len(kvs)
                for w in workloads:
                    for s in up:
                        if s.proc.poll() is None:
                            one(s, w)
                        else:
                            doc["errors"].append(f"{shape} {s.kv}: server died "
                                                 f"(rc {s.proc.returncode})")
                stop_all()
            else:
                for kv in kvs:
                    up = start(shape, [kv], port)
                    port += 1
                    for w in workloads:
                        for s in up:
                            one(s, w)
                    stop_all()
    except KeyboardInterrupt as e:
        doc["errors"].append(f"interrupted: {e}")
        print(doc["errors"][-1], flush=True)
    finally:
        stop_all()
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
