"""Single-stream CPU decode speed of ``jfp8kv.LLM`` (greedy), bf16 and fp8 KV caches.

    python -m bench.cpu_decode [--model M] [--max-model-len 4096] [--tokens 64]
        [--kv bfloat16 fp8_e4m3] [--kv-cache-memory BYTES] [--out bench/results/cpu-decode.json]

For each KV dtype: build the LLM (load time), one warm-up generate (compiles the shapes it
uses), then a timed generate of ``--tokens`` tokens after a short prompt. The JSON records
the machine (CPU model, cores, /proc/loadavg before and after each run: other processes
share the cores), versions and the exact command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_one(args, kv: str) -> dict:
    from jfp8kv import LLM, SamplingParams

    la0 = loadavg()
    t0 = time.perf_counter()
    llm = LLM(model=args.model, kv_cache_dtype=kv, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_memory)
    load_s = time.perf_counter() - t0
    prompt = "Write a short story about a lighthouse keeper."
    sp = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([prompt], sp)
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = llm.generate([prompt], sp)[0]
    dt = time.perf_counter() - t0
    info = llm.cache_info()
    return dict(kv_cache_dtype=kv, kv_scale_mode=info["kv_scale_mode"],
                max_model_len=args.max_model_len, pool_bytes=info["pool_bytes"],
                tokens=len(out.token_ids), seconds=dt, tok_per_s=len(out.token_ids) / dt,
                load_s=load_s, first_generate_s=warm_s, first_tokens=out.token_ids[:8],
                loadavg_before=la0, loadavg_after=loadavg())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--kv", nargs="+", default=["bfloat16", "fp8_e4m3"])
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--out", default="bench/results/cpu-decode.json")
    args = p.parse_args(argv)
    import jax

    runs = []
    for kv in args.kv:
        runs.append(run_one(args, kv))
        print(json.dumps(runs[-1]), flush=True)
    doc = dict(command=" ".join([Path(sys.executable).name, "-m", "bench.cpu_decode",
                                 *(argv if argv is not None else sys.argv[1:])]),
               machine=dict(cpu=cpu_model(), cores=os.cpu_count(), platform=platform.platform()),
               versions=dict(python=platform.python_version(), jax=jax.__version__,
                             jaxlib=getattr(jax.lib, "__version__", None) or
                             __import__("jaxlib").__version__),
               runs=runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
