"""Decode step time against its memory floor, bf16 vs fp8 KV, on a real architecture's shape.

A decode step must read every weight once and every live token's K/V once, so its floor is
(weight bytes + KV bytes) / copy bandwidth, with the copy bandwidth measured in the same run.
The step is the engine's own jitted multi-step decode (``decode_steps`` tokens per dispatch),
timed over full batches whose pages hold random data (never zeros).

    python bench/decode_floor.py --model random:qwen3-8b --batch 64 --context 8192 \
        --out bench/results/decode-floor-h200.json
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import command_line, copy_bandwidth_tbps, machine_info, write_result  # noqa: E402
from jfp8kv import LLM  # noqa: E402
from jfp8kv.engine.runner import SamplingArrays  # noqa: E402
from jfp8kv.kvcache.cache import KVCache  # noqa: E402


def fill_random(cache: KVCache, key) -> None:
    """Overwrite pages (and dynamic scales) with random data, one layer at a time, in place,
    so the pool never exists twice on the device and no timing runs on zeros."""
    @jax.jit
    def rnd(x, k):
        return (jax.random.normal(k, x.shape, jnp.float32) * 2).astype(x.dtype)

    @jax.jit
    def rnd_scale(x, k):
        return (jax.random.uniform(k, x.shape) * 0.02 + 0.001).astype(x.dtype)

    for i in range(len(cache.k)):
        for j, (arrs, fn) in enumerate(((cache.k, rnd), (cache.v, rnd),
                                        (cache.k_scale, rnd_scale), (cache.v_scale, rnd_scale))):
            if arrs[i].ndim >= 3:  # pages and dynamic scales; static scales stay
                k = jax.random.fold_in(key, 4 * i + j)
                old = arrs[i]
                arrs[i] = fn(old, k)
                old.delete()


def measure(model, kv, mode, batch, context, steps, reps, dtype):
    max_len = context + steps + 16
    probe = dict(model=model, dtype=dtype, kv_cache_dtype=kv, kv_scale_mode=mode,
                 kv_scales=0.05 if mode in ("tensor", "channel") else None,
                 max_model_len=max_len, max_num_seqs=batch, decode_steps=steps)
    pages_per_seq = math.ceil(max_len / 16)
    from jfp8kv.kvcache.cache import bytes_per_token
    from jfp8kv.models.loader import load_model

    loaded = load_model(model, dtype)
    cfg = loaded.config
    storage = {"bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv]
    bpt = bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, storage,
                          mode if storage.startswith("float8") else None)
    mem = (batch * pages_per_seq + 2) * 16 * bpt + (1 << 24)
    llm = LLM(loaded=loaded, **probe, kv_cache_memory=mem)
    runner = llm.engine.runner
    fill_random(runner.cache, jax.random.PRNGKey(1))
    rows = [(7 + i, context, list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)),
             context + steps) for i in range(batch)]
    samp = SamplingArrays.empty(batch)
    toks = runner.decode(rows, samp, True, steps)  # compile
    jax.block_until_ready(toks)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(runner.decode(rows, samp, True, steps))
        times.append(time.perf_counter() - t0)
    step_ms = float(np.median(times)) / steps * 1e3
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(loaded.params))
    kv_bytes = batch * (context + steps / 2) * bpt
    del llm, runner, loaded
    gc.collect()
    return dict(kv_cache_dtype=kv, kv_scale_mode=mode, batch=batch, context=context,
                step_ms=step_ms, weight_bytes=int(weight_bytes), kv_bytes=int(kv_bytes),
                bytes_per_token=bpt, decode_steps=steps, reps=reps,
                step_ms_all=[t / steps * 1e3 for t in times])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="random:qwen3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--configs", default="bfloat16:,fp8_e4m3:token,fp8_e4m3:tensor")
    p.add_argument("--out", default="bench/results/decode-floor-h200.json")
    args = p.parse_args(argv)
    copy = copy_bandwidth_tbps()
    records = []
    for item in args.configs.split(","):
        kv, mode = item.split(":")
        r = measure(args.model, kv, mode or None, args.batch, args.context, args.steps,
                    args.reps, args.dtype)
        r["model_shape"] = args.model
        r["floor_ms"] = (r["weight_bytes"] + r["kv_bytes"]) / (copy * 1e12) * 1e3
        r["step_over_floor"] = r["step_ms"] / r["floor_ms"]
        records.append(r)
        print(f"{args.model} {kv:9s} {mode or '-':7s} B={args.batch} ctx={args.context}: "
              f"step {r['step_ms']:.3f} ms, floor {r['floor_ms']:.3f} ms "
              f"({r['step_over_floor']:.2f}x)", flush=True)
    doc = dict(machine=machine_info(), command=command_line(),
               copy_tbps=copy, floor=records)
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
