"""How the warm-up's compile time grows with the model's layer count (layers are unrolled in
the HLO: ``transformer.forward`` loops over them in Python).

    python -m bench.compile_layers [--preset qwen3-0.6b] [--layers 4,8,16,28]
        [--max-model-len 1024] [--out bench/results/compile-layers-cpu.json]

Each layer count runs in its own process (a fresh JAX, the compilation cache off): the
preset's shapes with ``num_layers`` replaced, random weights, ``LLM.warmup()``, and the
start-up profile's warm-up phase (executables, seconds tracing+lowering and compiling,
summed over the parallel threads, and its wall time). The fit per layer says what a scan
over the layers (one layer's body compiled) could save; the intercept is what it keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from bench.common import command_line, machine_info, write_result

CHILD = """
import json, os, sys, time
os.environ["JFP8KV_COMPILE_CACHE"] = "0"
from jfp8kv.models.presets import PRESETS
from jfp8kv.engine import startup_profile
import jfp8kv
preset, layers, max_len, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
name = f"{preset}-l{layers}"
PRESETS[name] = dict(PRESETS[preset], num_layers=layers)
t0 = time.perf_counter()
llm = jfp8kv.LLM(model="random:" + name, max_model_len=max_len, kv_cache_dtype=dtype,
                 compile_cache=False)
llm.warmup(progress=False)
w = startup_profile.summary()["phases"]["warmup"]
print("RESULT " + json.dumps({"layers": layers, "start_s": round(time.perf_counter() - t0, 2),
      "executables": w["executables"], "lower_s": w["lower_s"], "compile_s": w["compile_s"],
      "warmup_wall_s": w["wall_s"]}))
"""


def run_one(preset: str, layers: int, max_len: int, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, preset, str(layers), str(max_len), dtype],
                         capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, JFP8KV_COMPILE_CACHE="0"))
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"layers={layers} failed:\n{out.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--layers", default="4,8,16,28")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    ap.add_argument("--out", default="bench/results/compile-layers-cpu.json")
    args = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.layers.split(",")):
        rows.append(run_one(args.preset, n, args.max_model_len, args.kv_cache_dtype))
        print(json.dumps(rows[-1]), flush=True)
    fit = {}
    for key in ("compile_s", "lower_s", "warmup_wall_s"):
        slope, icpt = np.polyfit([r["layers"] for r in rows], [r[key] for r in rows], 1)
        fit[key] = {"per_layer_s": round(float(slope), 3), "intercept_s": round(float(icpt), 2)}
    deepest = max(rows, key=lambda r: r["layers"])
    per = fit["compile_s"]["per_layer_s"] + fit["lower_s"]["per_layer_s"]
    total = deepest["compile_s"] + deepest["lower_s"]
    doc = {"command": command_line("bench.compile_layers", argv), "machine": machine_info(),
           "preset": args.preset, "max_model_len": args.max_model_len,
           "kv_cache_dtype": args.kv_cache_dtype, "rows": rows, "fit": fit,
           "per_layer_share_at_deepest": round(per * (deepest["layers"] - 1) / total, 3)}
    write_result(args.out, doc)
    print(json.dumps(fit), f"per-layer share of lower+compile at {deepest['layers']} layers:",
          doc["per_layer_share_at_deepest"])


if __name__ == "__main__":
    main()
