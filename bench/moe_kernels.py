"""MoE grouped matmul on one GPU: jax.lax.ragged_dot vs the Pallas ``pallas_gmm.gmm``.

    python -m bench.moe_kernels --out bench/results/moe-kernels-h200.json [--budget-s 480]
    python -m bench.moe_kernels --smoke          # tiny shapes, interpret mode, CPU

One SwiGLU gate matmul ``[M, D] x [E, D, I] -> [M, I]`` (bf16 operands, f32 result, as
``moe.grouped_experts`` runs it) for DeepSeek-V2-Lite (D 2048, I 1408, E 64, top-6) and
Qwen3-30B-A3B (D 2048, I 768, E 128, top-8), M = tokens * k for tokens in (64, 8192), rows
grouped by uniform random top-k routing (k distinct experts per token). Per config: median
ms (``bench.kernels.timed`` over a dependent chain), useful TFLOP/s (2 M D I / time) and
the byte floor (each hit expert's weights read once + rows in + f32 rows out, at the
measured copy bandwidth). The gmm default tuning runs for every case; a (tm, tn, tk,
num_warps) sweep for the 8192-token cases. ragged_dot is timed from one run when a single
call exceeds ``--slow-s`` (XLA's GPU ragged_dot is dense over all E experts). gmm's max abs
error vs ragged_dot is checked on the device (skipped, and said so, when ragged_dot is too
slow). A config that errors is recorded; configs past ``--budget-s`` are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.gmm_tuning import route
from bench.kernels import chain, timed
from jfp8kv.kernels import pallas_gmm

MODELS = {"deepseek-v2-lite": dict(d=2048, i=1408, e=64, k=6),
          "qwen3-30b-a3b": dict(d=2048, i=768, e=128, k=8)}
TOKENS = (64, 8192)
SWEEP = dict(tm=(64, 128), tn=(64, 128), tk=(32, 64), num_warps=(4, 8))
SMOKE_MODELS = {"tiny": dict(d=64, i=48, e=8, k=2)}
SMOKE_SWEEP = dict(tm=(16,), tn=(16, 32), tk=(32,), num_warps=(4,))


def make_case(rng, tokens: int, d: int, i: int, e: int, k: int):
    """(lhs bf16 [M, D] sorted by expert, rhs bf16 [E, D, I], sizes int32[E], experts hit)."""
    sizes = route(rng, tokens, e, k)  # k distinct experts each
    lhs = jnp.asarray(rng.standard_normal((tokens * k, d), np.float32), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((e, d, i), np.float32) * d ** -0.5, jnp.bfloat16)
    return lhs, rhs, jnp.asarray(sizes), int((sizes > 0).sum())


def op(impl: str, tuning, interpret: bool):
    if impl == "ragged_dot":
        return functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32)
    return functools.partial(pallas_gmm.gmm, preferred_element_type=jnp.float32,
                             tuning=tuning, interpret=interpret)


def measure(fn, args, slow_s: float):
    """(median ms, reps, samples): ``timed`` unless one call already takes > slow_s."""
    make = chain(fn)
    one = make(1)
    jax.block_until_ready(one(*args))  # compile
    t = time.perf_counter()
    jax.block_until_ready(one(*args))
    first = time.perf_counter() - t
    if first > slow_s:
        return first * 1e3, 1, 1
    ms, reps = timed(make, *args, est_ms=first * 1e3, calls=10)
    return ms, reps, 10


def record(base: dict, impl: str, tuning, fn, args, slow_s: float, floor: dict, ref=None):
    rec = dict(base, impl=impl, tuning=None if tuning is None else dataclasses.asdict(tuning))
    try:
        ms, reps, samples = measure(fn, args, slow_s)
        rec.update(ms=round(ms, 4), reps=reps, samples=samples,
                   useful_tflops=round(base["flops"] / ms / 1e9, 2),
                   floor_fraction=round(floor["floor_ms"] / ms, 3))
        if ref is not None:
            out = jax.block_until_ready(fn(*args))
            rec["max_abs_err"] = float(jnp.max(jnp.abs(out - ref)))
            rec["ref_max_abs"] = float(jnp.max(jnp.abs(ref)))
    except Exception as exc:  # noqa: BLE001 - a failed config is a result too
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    tun = "" if tuning is None else " ".join(f"{k}={v}" for k, v in rec["tuning"].items())
    print(f"{base['model']} tokens={base['tokens']} M={base['M']} {impl} {tun} "
          + (f"ms={rec['ms']} TF/s={rec['useful_tflops']} floor={floor['floor_ms']:.4f}ms"
             if "ms" in rec else f"ERROR {rec['error'][:200]}")
          + (f" max_abs_err={rec['max_abs_err']:.3g}" if "max_abs_err" in rec else ""),
          flush=True)
    return rec


def case_floor(tokens: int, m: int, d: int, i: int, hit: int, tbps: float) -> dict:
    nbytes = hit * d * i * 2 + m * d * 2 + m * i * 4
    return dict(bytes=nbytes, floor_ms=round(nbytes / (tbps * 1e12) * 1e3, 4))


def sweep_tunings(grid: dict):
    for tm, tn, tk, nw in itertools.product(*(grid[k] for k in ("tm", "tn", "tk", "num_warps"))):
        yield pallas_gmm.GmmTuning(tm=tm, tn=tn, tk=tk, num_warps=nw)


def run_case(doc, rng, model, shape, tokens, args, deadline, tbps):
    """ragged_dot, gmm default (+ error vs ragged_dot), and the sweep for big batches."""
    interpret = args.smoke
    lhs, rhs, sizes, hit = make_case(rng, tokens, **shape)
    m = lhs.shape[0]
    base = dict(model=model, tokens=tokens, M=m, D=shape["d"], I=shape["i"], E=shape["e"],
                k=shape["k"], experts_hit=hit, flops=2 * m * shape["d"] * shape["i"])
    floor = case_floor(tokens, m, shape["d"], shape["i"], hit, tbps)
    base.update(floor)
    operands = (lhs, rhs, sizes)
    if args.ragged_max_tokens is not None and tokens > args.ragged_max_tokens:
        rec = dict(base, impl="ragged_dot", skipped=f"tokens > --ragged-max-tokens "
                   f"{args.ragged_max_tokens}")
        print(f"{model} tokens={tokens} ragged_dot: skipped ({rec['skipped']})", flush=True)
    else:
        rec = record(base, "ragged_dot", None, op("ragged_dot", None, False), operands,
                     args.slow_s, floor)
    doc["records"].append(rec)
    ref = None
    if "ms" in rec and rec["ms"] < args.slow_s * 1e3:
        ref = jax.block_until_ready(op("ragged_dot", None, False)(*operands))
    tunings = [None]
    if tokens >= args.sweep_min_tokens:
        tunings += list(sweep_tunings(SMOKE_SWEEP if args.smoke else SWEEP))
    for tuning in tunings:
        if time.monotonic() > deadline:
            doc["skipped"].append(dict(model=model, tokens=tokens, tuning=str(tuning)))
            print(f"{model} tokens={tokens} gmm {tuning}: skipped (budget)", flush=True)
            continue
        impl = "gmm" if tuning else "gmm_default"
        t = tuning or pallas_gmm.GmmTuning(tm=pallas_gmm.choose_tm(m, shape["e"]))
        if ref is None and tuning is None:
            print(f"{model} tokens={tokens}: gmm error check skipped (ragged_dot too slow)")
        doc["records"].append(record(base, impl, t, op("gmm", t, interpret), operands,
                                     args.slow_s, floor, ref))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/moe-kernels-h200.json")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--slow-s", type=float, default=2.0,
                    help="one call slower than this is timed once, not in a chain")
    ap.add_argument("--sweep-min-tokens", type=int, default=8192)
    ap.add_argument("--ragged-max-tokens", type=int, default=None,
                    help="skip ragged_dot above this many tokens (XLA's dense form on NVIDIA "
                         "GPUs takes tens of seconds per call at 8192)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    args = ap.parse_args(argv)
    models = SMOKE_MODELS if args.smoke else {n: MODELS[n] for n in args.models.split(",")}
    tokens = (8, 64) if args.smoke else tuple(int(t) for t in args.tokens.split(","))
    if args.smoke:
        args.sweep_min_tokens = 64
    if args.smoke and args.out == ap.get_default("out"):
        args.out = "/tmp/moe-kernels-smoke.json"
    deadline = time.monotonic() + args.budget_s
    doc = {"machine": common.machine_info(), "command": common.command_line(
        "bench.moe_kernels", argv) if argv is not None else common.command_line(),
        "records": [], "skipped": []}
    doc["versions"] = doc["machine"].pop("versions")
    tbps = common.copy_bandwidth_tbps(1 << 16) if args.smoke else common.copy_bandwidth_tbps()
    doc["copy_tbps"] = round(tbps, 3)
    rng = np.random.default_rng(0)
    for (model, shape), t in itertools.product(models.items(), tokens):
        run_case(doc, rng, model, shape, t, args, deadline, tbps)
        common.write_result(args.out, doc)  # partial results survive a kill
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
