"""Where a prefill step's device time goes, bf16 vs fp8 KV, on a real architecture's shape.

One engine prefill step (``rows`` prompts of ``chunk`` new tokens after ``prefix`` cached
ones, the way ``LLMEngine`` dispatches it) is timed, then traced once with the profiler
(``bench.profile_trace``): kernels by kind (GEMMs, the Pallas prefill and store kernels, XLA
fusions), busy vs span, and the costliest kernels. The record also gives the step's FLOPs
(matmuls, logits of the last rows, causal attention pairs) and the rates they imply, so a
step can be set against its ideal at the matmul rate measured in the same run (the ideal
``bench.offline`` charges prefill with).

    python -m bench.prefill_profile --model random:qwen3-8b --rows 2 --chunk 4096 \\
        --configs bfloat16:,fp8_e4m3:token --out bench/results/prefill-profile-h200.json
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time

import jax
import numpy as np

from bench import internals, profile_trace
from bench.common import (command_line, machine_info, matmul_tflops, override_gmm_tuning,
                          write_result)
from bench.offline import model_terms, prefill_flops
from jfp8kv.engine.stats import causal_pairs


def measure(args, kv: str, mode: str | None, rate_tflops: float) -> dict:
    """Build an engine for ``kv``/``mode``, time ``args.reps`` prefill steps and profile one."""
    from jfp8kv import LLM
    from jfp8kv.models.loader import load_model

    loaded = load_model(args.model, args.dtype)
    cfg = loaded.config
    ps, rows, total = 16, args.rows, args.prefix + args.chunk
    pages = math.ceil(total / ps)
    memory = (rows * pages + 2) * ps * internals.kv_bytes_per_token(cfg, kv, mode, args.dtype) + (1 << 24)
    llm = LLM(loaded=loaded, dtype=args.dtype, kv_cache_dtype=kv, kv_scale_mode=mode,
              kv_scales=0.05 if mode in ("tensor", "channel") else None,
              max_model_len=total + ps, max_num_seqs=rows,
              max_num_batched_tokens=max(rows * args.chunk, 16), page_size=ps,
              kv_cache_memory=memory, warmup=False)
    pools = llm.engine.runner.cache.pools
    if set(pools) == {"kv"}:  # a dense paged cache: random pages to read
        internals.fill_cache_random(llm, jax.random.PRNGKey(1))
    elif args.prefix:  # V4's pools and the hybrid's states hold no random-fill path
        raise ValueError(f"--prefix needs a dense paged cache; {args.model}'s cache has the "
                         f"pools {sorted(pools)}: use --prefix 0")
    ps = llm.cache_plan.page_size  # V4's pools may round the page up (compression ratio)
    pages = math.ceil(total / ps)
    rng = np.random.default_rng(0)
    chunks = [(rng.integers(3, cfg.vocab_size, args.chunk).tolist(), args.prefix,
               list(range(1 + i * pages, 1 + (i + 1) * pages))) for i in range(rows)]
    run = _step(llm, chunks)
    run()  # compile
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    kernels = profile_trace.profile(run)
    del run, llm, loaded
    gc.collect()
    ms = float(np.median(times)) * 1e3
    flops = prefill_flops(model_terms(cfg, args.dtype), rows * args.chunk, rows,
                          rows * causal_pairs(args.chunk, args.prefix))
    ideal_ms = flops / (rate_tflops * 1e12) * 1e3
    return dict(kv_cache_dtype=kv, kv_scale_mode=mode, rows=rows, chunk=args.chunk,
                prefix=args.prefix, step_ms=ms, step_ms_all=[t * 1e3 for t in times],
                flops=flops, tflops=flops / ms / 1e9, ideal_ms=ideal_ms,
                step_over_ideal=ms / ideal_ms, kernels=kernels)


def _step(llm, chunks):
    """The timed call: one engine prefill step of ``chunks``, waited for."""
    return lambda: jax.block_until_ready(internals.prefill_dispatch(llm, chunks))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:qwen3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--prefix", type=int, default=0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--configs", default="bfloat16:,fp8_e4m3:token")
    p.add_argument("--out", default="bench/results/prefill-profile-h200.json")
    p.add_argument("--gmm-tuning", default=None, metavar="SWEEP_JSON",
                   help="run the MoE grouped matmul with the fastest tunings a "
                        "bench.gmm_tuning result measured for its shapes")
    args = p.parse_args(argv)
    gmm_tuning = override_gmm_tuning(args.gmm_tuning)
    rate = matmul_tflops()
    records = []
    for item in args.configs.split(","):
        kv, mode = item.split(":")
        r = measure(args, kv, mode or None, rate)
        r["model_shape"] = args.model
        records.append(r)
        k = r["kernels"]
        print(f"{args.model} {kv:9s} {mode or '-':6s} {args.rows}x{args.chunk} after "
              f"{args.prefix}: {r['step_ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s, "
              f"{r['step_over_ideal']:.2f}x ideal", flush=True)
        if k.get("kernels"):
            print("  " + ", ".join(f"{n} {v['kernels']:.0f}/{v['us'] / 1e3:.2f} ms"
                                   for n, v in k["by_kind"].items()), flush=True)
    command = command_line("bench.prefill_profile", argv) if argv is not None else command_line()
    write_result(args.out, dict(machine=machine_info(), command=command,
                                matmul_tflops=rate, gmm_tuning=gmm_tuning, records=records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
