"""Decode step time against its memory floor, bf16 vs fp8 KV, on a real architecture's shape.

A decode step must read every weight once and every live token's K/V once, so its floor is
(weight bytes + KV bytes) / copy bandwidth, with the copy bandwidth measured in the same run.
The step is the engine's own jitted multi-step decode (``decode_steps`` tokens per dispatch),
timed over full batches whose pages hold random data (never zeros).

    python -m bench.decode_floor --model random:qwen3-8b --batch 64 --context 8192 \
        --out bench/results/decode-floor-h200.json

``--decode-one-wave off`` times it with the decode kernel's splits chosen as before the
one-wave rule (``pallas_decode.ONE_WAVE``), for an A/B in one call.
A config ``fp8_e4m3:block+smooth`` times a K transform (``kv_rotation``) beside the others
(issue 36 point 4: the cost of a default candidate against ``token``).
``--decode-variant pagepf+asm+vmask`` times the step with another decode kernel variant for
fp8 pages (``jfp8kv.kernels.tiles.Variant``) in place of the default.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import sys
import time

import jax
import numpy as np

from bench import internals, profile_trace
from bench.common import (command_line, copy_bandwidth_tbps, machine_info,
                          override_decode_tuning, override_split_loop,
                          write_result)
from jfp8kv import LLM
from jfp8kv.config import GEMM_AUTOTUNE


# --samplers: what each row of the timed dispatch asks the sampler for, and which executable
# structure serves it (EngineConfig.feature_executables; plain rows never run the switched one)
SAMPLERS = {"plain": (False, None), "logprobs:switched": (True, "switched"),
            "logprobs:per-mix": (True, "per-mix")}


def profile_dispatch(dispatch, steps) -> dict:
    """One more decode dispatch under the profiler: its kernels per decode step."""
    return profile_trace.profile(lambda: jax.block_until_ready(dispatch()), per=steps)


def measure(model, kv, mode, batch, context, steps, reps, dtype, profile=False, page_size=16,
            gemm_autotune=None, rotation="none", sampler="plain"):
    max_len = context + steps + page_size
    logprobs, features = SAMPLERS[sampler]
    probe = dict(model=model, dtype=dtype, kv_cache_dtype=kv, kv_scale_mode=mode,
                 kv_scales=0.05 if mode in ("tensor", "channel") else None, kv_rotation=rotation,
                 max_model_len=max_len, max_num_seqs=batch, decode_steps=steps,
                 page_size=page_size,
                 **({"decode_gemm_autotune": gemm_autotune} if gemm_autotune else {}),
                 **({"feature_executables": features} if features else {}))
    pages_per_seq = math.ceil(max_len / page_size)
    from jfp8kv.models.loader import load_model

    loaded = load_model(model, dtype)
    cfg = loaded.config
    bpt = internals.kv_bytes_per_token(cfg, kv, mode, dtype)
    mem = (batch * pages_per_seq + 2) * page_size * bpt + (1 << 24)
    llm = LLM(loaded=loaded, **probe, kv_cache_memory=mem, warmup=False)
    internals.fill_cache_random(llm, jax.random.PRNGKey(1))
    rows = [(7 + i, context, list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)),
             context + steps) for i in range(batch)]
    def dispatch():
        return internals.decode_dispatch(llm, rows, steps, logprobs=logprobs)

    jax.block_until_ready(dispatch())  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(dispatch())
        times.append(time.perf_counter() - t0)
    step_ms = float(np.median(times)) / steps * 1e3
    kernels = profile_dispatch(dispatch, steps) if profile else None
    weight_bytes = internals.weight_bytes(llm)
    kv_bytes = batch * (context + steps / 2) * bpt
    autotune = llm.engine_config.decode_gemm_autotune
    del llm, loaded
    gc.collect()
    return dict(kv_cache_dtype=kv, kv_scale_mode=mode, kv_rotation=rotation, batch=batch,
                context=context, sampler=sampler,
                step_ms=step_ms, weight_bytes=int(weight_bytes), kv_bytes=int(kv_bytes),
                bytes_per_token=bpt, decode_steps=steps, reps=reps, page_size=page_size,
                decode_gemm_autotune=autotune,
                step_ms_all=[t / steps * 1e3 for t in times],
                **({"kernels_per_step": kernels} if kernels else {}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="random:qwen3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--configs", default="bfloat16:,fp8_e4m3:token,fp8_e4m3:tensor",
                   help="comma-separated kv_cache_dtype:scale_mode[+kv_rotation][:page_size] "
                        "(page size default 16), e.g. fp8_e4m3:token:32, fp8_e4m3:block+smooth "
                        "(smooth calibrates its K means at start-up)")
    p.add_argument("--profile", action="store_true",
                   help="also trace one dispatch and summarize its kernels per decode step "
                        "(count, busy vs span, by kind, costliest: bench.profile_trace)")
    p.add_argument("--decode-variant", default=None, metavar="VARIANT",
                   help="fp8 pages: this decode kernel variant instead of the default, e.g. "
                        "pagepf+asm+vmask")
    p.add_argument("--decode-one-wave", choices=("on", "off"), default="on",
                   help="off: the decode kernel splits as before the one-wave rule (A/B)")
    p.add_argument("--split-loop", choices=("on", "off"), default=None,
                   help="the attention kernels' unmasked loop over full tiles "
                        "(Variant.split_loop; default: the kernels' default), for an A/B")
    p.add_argument("--decode-gemm-autotune", choices=GEMM_AUTOTUNE, default=None,
                   help="XLA's GEMM tiling search for the decode step (default: the engine's)")
    p.add_argument("--samplers", default="plain",
                   help="comma list of what every row asks the sampler for, each timed: "
                        + ", ".join(SAMPLERS) + " (log-probs through the switched or the "
                        "per-mix executable: their cost side by side)")
    p.add_argument("--out", default="bench/results/decode-floor-h200.json")
    args = p.parse_args(argv)
    samplers = args.samplers.split(",")
    if bad := sorted(set(samplers) - set(SAMPLERS)):
        p.error(f"--samplers: unknown {bad}; choose from {', '.join(SAMPLERS)}")
    override_decode_tuning(args.decode_variant, args.decode_one_wave == "on")
    override_split_loop(None if args.split_loop is None else args.split_loop == "on")
    copy = copy_bandwidth_tbps()
    records = []
    for item, sampler in itertools.product(args.configs.split(","), samplers):
        kv, mode, *page = item.split(":")
        mode, _, rotation = mode.partition("+")
        r = measure(args.model, kv, mode or None, args.batch, args.context, args.steps,
                    args.reps, args.dtype, args.profile, int(page[0]) if page else 16,
                    args.decode_gemm_autotune, rotation or "none", sampler)
        r["model_shape"] = args.model
        r["decode_variant"] = args.decode_variant if kv.startswith("fp8") else None
        r["decode_one_wave"] = args.decode_one_wave
        r["split_loop"] = args.split_loop or "default"
        r["floor_ms"] = (r["weight_bytes"] + r["kv_bytes"]) / (copy * 1e12) * 1e3
        r["step_over_floor"] = r["step_ms"] / r["floor_ms"]
        records.append(r)
        print(f"{args.model} {kv:9s} {mode or '-':7s} {rotation or '-':15s} {sampler} "
              f"S={r['page_size']} B={args.batch} "
              f"ctx={args.context}: "
              f"step {r['step_ms']:.3f} ms, floor {r['floor_ms']:.3f} ms "
              f"({r['step_over_floor']:.2f}x)", flush=True)
        k = r.get("kernels_per_step")
        if k and k.get("kernels"):
            print(f"  per step: {k['kernels']:.0f} kernels, busy {k['busy_us']:.0f} us of "
                  f"{k['span_us']:.0f} us span; " + ", ".join(
                      f"{n} {v['kernels']:.0f}/{v['us']:.0f} us" for n, v in k["by_kind"].items()),
                  flush=True)
    doc = dict(machine=machine_info(), command=command_line(),
               copy_tbps=copy, floor=records)
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
