"""Issue 34: Mosaic GPU prefill attention over fp8 pages, dequantized (fp8 tiles upcast to
f16, 16-bit products) against fp8 products (``MosaicPrefillTuning(compute="fp8")``: e4m3 q
rows, q.K^T an e4m3 wgmma), beside bf16 pages, timed side by side in one run
(``bench.kernels.timed_interleaved``: every call of every variant in turn), 32 query / 8 KV
heads, head_dim 128, 16-token pages, causal, at 8,192 new over 8,192 and 2,048 new after
4,096 (6,144 keys):

    python -m bench.prefill_fp8 --out bench/results/prefill-fp8-h200.json

Rows: setting (bf16 | fp8 dequant | fp8 products), kv_scale_mode, ms, tflops,
ratio_vs_bf16, and per fp8 mode ``ratio_vs_dequant``; accuracy rows (same pages, one call):
the fp8-products output against the dequantizing kernel's (``rel_rms``, ``max_abs``) and,
at the smaller shape, against the jnp twin (``twin_max_abs``: the same quantized products,
so only summation order and approximate exp2 differ). ``--lower-only`` lowers every
variant for CUDA instead (works on the CPU: the pre-check).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.kernels import cache_cfg, make_layer, prefill_chain, timed_interleaved
from jfp8kv.kernels import fp8_products, mosaic_prefill

SHAPES = ((1, 8192, 0), (1, 2048, 4096))  # (batch, new tokens, cached prefix)
HEADS = (32, 8, 128)
VARIANTS = (("bf16", "bfloat16", None, "dequant"),
            *((f"fp8 {'products' if c == 'fp8' else c}", "float8_e4m3fn", m, c)
              for m in ("token", "tensor", "channel") for c in ("dequant", "fp8")))


def _case(rng, storage, mode, shape):
    batch, chunk, prefix = shape
    hq, hkv, d = HEADS
    ctx = prefix + chunk
    cfg = cache_cfg(storage, mode, hkv, d, 1 + batch * (-(-ctx // 16)), 16)
    layer, pt, lens = make_layer(rng, cfg, batch, ctx)
    q = jax.random.normal(jax.random.key(4), (batch, chunk, hq, d), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(prefix, ctx, dtype=jnp.int32), (batch, chunk))
    return cfg, (q, layer, pt, lens, pos)


def _tuning(compute):
    return mosaic_prefill.MosaicPrefillTuning(compute=compute)


def run_shape(shape, lower_only: bool):
    batch, chunk, prefix = shape
    hq, _, d = HEADS
    flops = 4 * batch * hq * d * (chunk * prefix + chunk * (chunk + 1) / 2)
    rng = np.random.default_rng(0)
    cases = {(s, m): _case(rng, s, m, shape) for _, s, m, _ in VARIANTS}
    sm = 1.0 / float(np.sqrt(d))
    if lower_only:
        for label, s, m, c in VARIANTS:
            cfg, args = cases[s, m]
            mosaic_prefill.prefill_attention.trace(*args, cfg, sm, tuning=_tuning(c)).lower(
                lowering_platforms=("cuda",))
            print("lowers", shape, label, m, flush=True)
        return []
    jobs = [(prefill_chain(cases[s, m][0], _tuning(c), False, "mosaic"), cases[s, m][1],
             flops / 4e11) for _, s, m, c in VARIANTS]
    timed = timed_interleaved(jobs, calls=8)
    rows = []
    for (label, _, m, c), (ms, reps) in zip(VARIANTS, timed):
        rows.append(dict(kind="time", setting=label, kv_scale_mode=m, batch=batch, tokens=chunk,
                         context=prefix + chunk, ms=round(ms, 5), reps=reps,
                         tflops=round(flops / ms / 1e9, 1)))
    bf = rows[0]["ms"]
    for i, r in enumerate(rows):
        r["ratio_vs_bf16"] = round(r["ms"] / bf, 3)
        if VARIANTS[i][3] == "fp8":
            r["ratio_vs_dequant"] = round(r["ms"] / rows[i - 1]["ms"], 3)
    for mode in ("token", "tensor", "channel"):
        cfg, args = cases["float8_e4m3fn", mode]
        deq, f8 = (np.asarray(mosaic_prefill.prefill_attention(*args, cfg, sm, tuning=_tuning(c)),
                              np.float32) for c in ("dequant", "fp8"))
        acc = dict(kind="accuracy", kv_scale_mode=mode, batch=batch, tokens=chunk,
                   context=prefix + chunk, rel_rms=float(np.sqrt(((f8 - deq) ** 2).mean()
                                                                 / (deq ** 2).mean())),
                   max_abs=float(np.abs(f8 - deq).max()), finite=bool(np.isfinite(f8).all()))
        if chunk <= 2048:
            twin = np.asarray(fp8_products.prefill_attention(*args, cfg, sm), np.float32)
            acc["twin_max_abs"] = float(np.abs(f8 - twin).max())
        rows.append(acc)
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/prefill-fp8-h200.json")
    ap.add_argument("--lower-only", action="store_true")
    args = ap.parse_args(argv)
    doc = {"machine": common.machine_info(),
           "command": common.command_line("bench.prefill_fp8", argv),
           "heads": HEADS, "page_size": 16, "rows": []}
    for shape in SHAPES:
        doc["rows"] += run_shape(shape, args.lower_only)
        if not args.lower_only:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
