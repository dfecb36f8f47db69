"""The README's server flow on this machine: start, /health, first chat answer, decode rate.

    python -m bench.cpu_start [--model M] [--kv-cache-dtype fp8_e4m3] [--max-model-len 4096]
        [--tokens 64] [--out bench/results/cpu-start.json]

On a GPU machine the same two starts give the server's cold and warm start times there
(``--model random:qwen3-8b``: a real architecture's shapes, random weights, every other
setting the server's default).

Starts ``python -m jfp8kv.serve --kv-cache-dtype ... --max-model-len ...`` twice against a
fresh JAX compilation-cache directory: "cold" (empty: everything compiles) and "warm" (the
entries the cold run wrote). Each run records seconds from launch to /health (and the
server's CPU seconds by then, which a shared machine's load does not inflate), the latency
of the first chat request after /health (greedy, ``--tokens`` tokens, ignore_eos), the rate
of a second identical request, then the latency and XLA compiles of the first request with
log-probs, with penalties, with prompt scoring (``echo``) and a chat with log-probs
(``first_feature_requests``), and /proc/loadavg (the machine may be shared).

``--fresh-venv`` first times the README's install as a new user runs it: a new virtual
environment, ``pip install --no-cache-dir -e .`` (no extras, nothing from pip's cache), then
serves from that environment with an empty model cache (``JFP8KV_CACHE`` in a temporary
directory, so the cold run includes the default model's download).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import nvidia_smi_gpu
from bench.long_request import startup_summary
from bench.cpu_decode import cpu_model, loadavg


def wait_health(url: str, proc, limit_s: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("no /health")


def chat(url: str, tokens: int) -> tuple[float, int]:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = dict(model=model, messages=[{"role": "user", "content": "Tell me about lighthouses."}],
                max_tokens=tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=900)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]


FEATURES = {  # the first request of each kind after /health: (path, body beyond the model)
    "logprobs": ("/v1/completions", dict(prompt="The lighthouse keeper", max_tokens=16,
                                         logprobs=5)),
    "penalties": ("/v1/completions", dict(prompt="The lighthouse keeper", max_tokens=16,
                                          presence_penalty=0.5, frequency_penalty=0.3,
                                          repetition_penalty=1.2)),
    "prompt_scoring": ("/v1/completions", dict(prompt="The lighthouse keeper climbed the stairs",
                                               max_tokens=0, echo=True, logprobs=1)),
    "chat_logprobs": ("/v1/chat/completions", dict(
        messages=[{"role": "user", "content": "Name a lighthouse."}], max_tokens=16,
        logprobs=True, top_logprobs=3)),
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its reaped children (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def compiles(url: str) -> float:
    """The server's ``jfp8kv_xla_compiles_total``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("jfp8kv_xla_compiles_total")))


def first_features(url: str) -> dict:
    """Each FEATURES request once, in order: latency and XLA compiles it caused."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    out = {}
    for name, (path, body) in FEATURES.items():
        before = compiles(url)
        t0 = time.perf_counter()
        r = httpx.post(url + path, json=dict(model=model, **body), timeout=900)
        r.raise_for_status()
        out[name] = dict(seconds=time.perf_counter() - t0, compiles=compiles(url) - before)
    return out


def fresh_install(root: str) -> tuple[str, float]:
    """A new venv under ``root`` with ``pip install --no-cache-dir -e .``; (python, seconds)."""
    t0 = time.perf_counter()
    venv = Path(root) / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    repo = Path(__file__).resolve().parent.parent
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-cache-dir", "-e", str(repo)],
                   check=True)
    return str(venv / "bin" / "python"), time.perf_counter() - t0


def run_once(args, cache_dir: str, label: str, python: str = sys.executable,
             extra_env: dict | None = None) -> dict:
    profile = Path(tempfile.gettempdir()) / f"cpu-start-{label}-profile.json"
    profile.unlink(missing_ok=True)
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1",
               JFP8KV_STARTUP_PROFILE=str(profile), **(extra_env or {}))
    cmd = [python, "-m", "jfp8kv.serve", "--kv-cache-dtype", args.kv_cache_dtype,
           "--max-model-len", str(args.max_model_len), "--port", str(args.port)]
    if args.model:
        cmd += ["--model", args.model]
    url = f"http://127.0.0.1:{args.port}"
    la0 = loadavg()
    t_start = time.perf_counter()
    log = open(Path(tempfile.gettempdir()) / f"cpu-start-{label}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        health_s = wait_health(url, proc, args.limit_s)
        cpu_health = cpu_seconds(proc.pid)  # the load-independent part of the start
        la_health = loadavg()
        first_s, n1 = chat(url, args.tokens)
        second_s, n2 = chat(url, args.tokens)
        features = first_features(url)
    finally:
        proc.terminate()
        proc.wait(60)
    return dict(run=label, command=" ".join(cmd[1:]), health_s=health_s,
                cpu_s_at_health=cpu_health,
                first_chat_s=first_s, first_chat_tokens=n1, second_chat_s=second_s,
                second_chat_tokens=n2, second_chat_tok_per_s=n2 / second_s,
                first_feature_requests=features, startup_profile=startup_summary(str(profile)),
                total_s=time.perf_counter() - t_start, loadavg_start=la0,
                loadavg_at_health=la_health, loadavg_end=loadavg())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the server's default model")
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--limit-s", type=float, default=1200)
    p.add_argument("--fresh-venv", action="store_true",
                   help="time a no-extras install into a new venv and serve from it")
    p.add_argument("--out", default="bench/results/cpu-start.json")
    args = p.parse_args(argv)
    runs, install = [], None
    with tempfile.TemporaryDirectory(prefix="jfp8kv-cpu-start-") as root:
        cache_dir, python, extra_env = os.path.join(root, "jax-cache"), sys.executable, {}
        if args.fresh_venv:
            la0 = loadavg()
            python, install_s = fresh_install(root)
            install = dict(command="pip install --no-cache-dir -e . (new venv, no extras)",
                           seconds=install_s, loadavg_start=la0, loadavg_end=loadavg())
            extra_env = dict(JFP8KV_CACHE=os.path.join(root, "jfp8kv-cache"))
            print(json.dumps(install), flush=True)
        for label in ("cold", "warm"):
            runs.append(run_once(args, cache_dir, label, python, extra_env))
            print(json.dumps(runs[-1]), flush=True)
    doc = dict(command=" ".join(["python", "-m", "bench.cpu_start",
                                 *(argv if argv is not None else sys.argv[1:])]),
               machine=dict(cpu=cpu_model(), cores=os.cpu_count(), gpu=nvidia_smi_gpu()),
               install=install, runs=runs)
    if install:
        doc["install_to_first_answer_s"] = (install["seconds"] + runs[0]["health_s"]
                                            + runs[0]["first_chat_s"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
