"""Serving benchmark matrix on the GPU: real server processes, bf16 vs fp8 KV.

For each model shape and KV dtype, starts ``python -m jfp8kv.serve`` (random weights of the
real architecture, ``--warmup on``), runs ``bench/serving.py`` for each workload
(input:output:concurrency:prompts), stops the server, and writes one JSON with the runs, the
decode-floor records (from ``bench/decode_floor.py``'s output, when given) and the outside
peer (Hugging Face transformers ``generate``, from ``--peer`` JSON when given).

    python bench/serving_h200.py --shapes random:qwen3-8b --kv bfloat16,fp8_e4m3 \
        --workloads 8192:128:32:64 --out bench/results/serving-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server on port {port} not healthy after {timeout_s:.0f} s")


def run_server_matrix(shape, kv, workloads, args, port) -> list[dict]:
    max_len = max(i + o for i, o, _, _ in workloads) + 64
    max_seqs = max(c for _, _, c, _ in workloads)
    cmd = [sys.executable, "-m", "jfp8kv.serve", "--model", shape, "--dtype", args.dtype,
           "--kv-cache-dtype", kv, "--max-model-len", str(max_len), "--max-num-seqs",
           str(max_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--port", str(port), "--warmup", args.warmup, "--log-level", "warning"]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
    mode = None
    if kv.startswith("fp8"):
        from jfp8kv.engine.llm import DEFAULT_FP8_SCALE_MODE

        mode = args.kv_scale_mode or DEFAULT_FP8_SCALE_MODE
        cmd += ["--kv-scale-mode", mode]
    t0 = time.monotonic()
    name = os.path.basename(shape.split(":")[-1])
    log = open(os.path.join(args.log_dir, f"server-{name}-{kv}.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    runs = []
    try:
        wait_healthy(port, proc, args.startup_timeout)
        startup_s = time.monotonic() - t0
        print(f"[{shape} {kv}] server up in {startup_s:.0f} s", flush=True)
        for inp, out, conc, n in workloads:
            with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as tmp:
                path = tmp.name
            bench = [sys.executable, os.path.join(ROOT, "bench", "serving.py"), "--port",
                     str(port), "--num-prompts", str(n), "--random-input-len", str(inp),
                     "--random-output-len", str(out), "--max-concurrency", str(conc),
                     "--ignore-eos", "--warmup-requests", str(conc),
                     "--disable-tqdm", "--output-file", path,
                     "--token-id-range", *map(str, args.token_id_range)]
            subprocess.run(bench, cwd=ROOT, check=True, timeout=args.run_timeout)
            with open(path) as f:
                rec = json.loads(f.readlines()[-1])
            rec.update(model_shape=shape, kv_cache_dtype=kv, kv_scale_mode=mode, input_len=inp, output_len=out,
                       max_concurrency=conc, num_prompts=n, server_startup_s=startup_s)
            runs.append(rec)
            print(f"[{shape} {kv}] in={inp} out={out} conc={conc}: median TTFT "
                  f"{rec.get('median_ttft_ms', float('nan')):.1f} ms, median ITL "
                  f"{rec.get('median_itl_ms', float('nan')):.2f} ms, output "
                  f"{rec.get('output_throughput', float('nan')):.0f} tok/s", flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return runs


def main(argv=None) -> int:
    from bench.common import command_line, machine_info, write_result

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="random:qwen3-8b")
    p.add_argument("--kv", default="bfloat16,fp8_e4m3")
    p.add_argument("--workloads", default="8192:128:32:64",
                   help="comma list of input:output:concurrency:num_prompts")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-scale-mode", default=None, help="fp8 mode (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--token-id-range", type=int, nargs=2, default=(1000, 30000))
    p.add_argument("--warmup", default="on", choices=("on", "off", "auto"))
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--startup-timeout", type=float, default=400)
    p.add_argument("--run-timeout", type=float, default=300)
    p.add_argument("--floor", default=None, help="decode_floor.py output to include")
    p.add_argument("--peer", default=None, help="peer JSON to include")
    p.add_argument("--log-dir", default=tempfile.gettempdir())
    p.add_argument("--out", default="bench/results/serving-h200.json")
    args = p.parse_args(argv)
    workloads = [tuple(int(x) for x in w.split(":")) for w in args.workloads.split(",")]
    doc = {"machine": machine_info(), "command": command_line(),
           "runs": [], "floor": [], "peer": [], "errors": []}

    def save():
        write_result(args.out, doc)

    port = 8321
    for shape in args.shapes.split(","):
        for kv in args.kv.split(","):
            try:
                doc["runs"] += run_server_matrix(shape, kv, workloads, args, port)
            except Exception as e:  # keep what was measured; record what failed
                doc["errors"].append(f"{shape} {kv}: {type(e).__name__}: {e}")
                print(doc["errors"][-1], flush=True)
            port += 1
            save()
    for key, path in (("floor", args.floor), ("peer", args.peer)):
        if path and os.path.exists(path):
            with open(path) as f:
                doc[key] = json.load(f).get(key, [])
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
