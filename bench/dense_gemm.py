"""Decode-sized dense GEMMs: XLA's dot against a Pallas skinny-GEMM prototype (issue 12).

The Qwen3-0.6B decode step spends 22 us per layer in its four GEMMs (M = 32 rows; 30 MB of
weights, 8 us at the copy rate; docs/lab/engine-notes.md). Is that XLA's tiling, or the floor
of a few-MB GEMM on this GPU? This bench answers it for the step's shapes: per shape, XLA's
``einsum(..., preferred_element_type=f32).astype(bf16)`` (as ``models/transformer._linear``)
and a sweep of a plain Pallas Triton kernel (grid: column blocks of ``bn`` x ``splits``
slices of K; each program streams its [K / splits, bn] weight slab in ``bk`` chunks through
a ``num_stages`` pipeline; split-K partials in f32, summed and cast by XLA), each timed as
a chain of dependent calls (``bench.kernels.timed_interleaved``: XLA and the best Pallas
config side by side). Run it under ``XLA_FLAGS=--xla_gpu_exhaustive_tiling_search=true``
(``--xla-only``) to see what XLA's exhaustive autotuning finds.

    python -m bench.dense_gemm --out bench/results/dense-gemm-h200.json
    python -m bench.dense_gemm --smoke          # tiny shapes, interpret mode, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bench import common
from bench.kernels import timed_interleaved
from jfp8kv.kernels.tiles import dot_nn

# (name, M, K, N): Qwen3-0.6B at batch 32 (qkv merged, o, gate+up merged, down), and
# Qwen3-8B at batch 64
SHAPES = (("06b-qkv", 32, 1024, 4096), ("06b-o", 32, 2048, 1024),
          ("06b-gateup", 32, 1024, 6144), ("06b-down", 32, 3072, 1024),
          ("8b-qkv", 64, 4096, 6144), ("8b-down", 64, 12288, 4096))
SMOKE_SHAPES = (("tiny", 16, 128, 64),)


@dataclasses.dataclass(frozen=True)
class Tiling:
    bn: int = 64
    bk: int = 128
    splits: int = 1
    num_stages: int = 4
    num_warps: int = 4


def _kernel(x_ref, w_ref, o_ref, *, bk, k_per_split, splits):
    j, s = pl.program_id(0), pl.program_id(1)
    m, bn = x_ref.shape[0], o_ref.shape[-1]
    k0 = s * k_per_split

    def body(i, acc):
        a = plgpu.load(x_ref.at[:, pl.ds(k0 + i * bk, bk)])
        b = plgpu.load(w_ref.at[pl.ds(k0 + i * bk, bk), pl.ds(j * bn, bn)])
        return acc + dot_nn(a, b)

    acc = jax.lax.fori_loop(0, k_per_split // bk, body, jnp.zeros((m, bn), jnp.float32))
    if splits == 1:
        o_ref[...] = acc.astype(o_ref.dtype)
    else:
        o_ref[0] = acc


@functools.partial(jax.jit, static_argnames=("t", "interpret"))
def skinny_gemm(x, w, *, t: Tiling, interpret: bool = False):
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype (f32 accumulation)."""
    (m, k), n = x.shape, w.shape[1]
    kps = k // t.splits
    kern = functools.partial(_kernel, bk=t.bk, k_per_split=kps, splits=t.splits)
    if t.splits == 1:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
        out_spec = pl.BlockSpec((m, t.bn), lambda j, s: (0, j))
    else:
        out_shape = jax.ShapeDtypeStruct((t.splits, m, n), jnp.float32)
        out_spec = pl.BlockSpec((1, m, t.bn), lambda j, s: (s, 0, j))
    out = pl.pallas_call(
        kern, grid=(n // t.bn, t.splits), out_shape=out_shape,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=out_spec, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        name="bench_skinny_gemm")(x, w)
    return out if t.splits == 1 else out.sum(0).astype(x.dtype)


def xla_gemm(x, w):
    return jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def gemm_chain(one):
    """reps -> jitted f(x, w): ``reps`` dependent GEMMs (x_{i+1} = x_i + 1e-3 out_i, cut or
    zero-padded to K)."""
    def make(reps):
        @jax.jit
        def f(x, w):
            acc = jnp.zeros((), jnp.float32)
            k = x.shape[1]
            for _ in range(reps):
                out = one(x, w)
                acc = acc + out[0, 0].astype(jnp.float32)
                step = out[:, :k] if out.shape[1] >= k else jnp.pad(
                    out, ((0, 0), (0, k - out.shape[1])))
                x = (x.astype(jnp.float32) + 1e-3 * step.astype(jnp.float32)).astype(x.dtype)
            return acc
        return f
    return make


def tilings(m, k, n, smoke: bool):
    if smoke:
        yield Tiling(bn=32, bk=32, splits=2, num_stages=1)
        yield Tiling(bn=64, bk=64, splits=1, num_stages=1)
        return
    for bn, bk, splits, ns in itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8),
                                                (3, 5)):
        programs = (n // bn) * splits
        if n % bn or k % splits or (k // splits) % bk or not 96 <= programs <= 1536:
            continue
        yield Tiling(bn=bn, bk=bk, splits=splits, num_stages=ns)


def run_shape(name, m, k, n, args, tbps, deadline):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * k ** -0.5, jnp.bfloat16)
    nbytes = (k * n + m * k + m * n) * 2
    floor_us = nbytes / (tbps * 1e12) * 1e6
    ref = np.asarray(xla_gemm(x, w).astype(jnp.float32))
    base = dict(shape=name, M=m, K=k, N=n, bytes=nbytes, floor_us=round(floor_us, 2))
    rows = []
    (xla_ms, reps), = timed_interleaved([(gemm_chain(xla_gemm), (x, w), 0.01)])
    rows.append(dict(base, impl="xla", us=round(xla_ms * 1e3, 2), reps=reps,
                     tbps=round(nbytes / (xla_ms * 1e-3) / 1e12, 3)))
    print(f"{name} M={m} K={k} N={n}: xla {xla_ms * 1e3:.2f} us (floor {floor_us:.2f})",
          flush=True)
    if args.xla_only:
        return rows
    best = None
    for t in tilings(m, k, n, args.smoke):
        if time.perf_counter() > deadline:
            rows.append(dict(base, impl="pallas", tiling=dataclasses.asdict(t),
                             skipped="budget"))
            continue
        one = functools.partial(skinny_gemm, t=t, interpret=args.smoke)
        row = dict(base, impl="pallas", tiling=dataclasses.asdict(t))
        try:
            out = np.asarray(one(x, w).astype(jnp.float32))
            row["max_abs_err"] = float(np.max(np.abs(out - ref)))
            (ms, reps), = timed_interleaved([(gemm_chain(one), (x, w), xla_ms)], calls=5)
            row.update(us=round(ms * 1e3, 2), reps=reps,
                       tbps=round(nbytes / (ms * 1e-3) / 1e12, 3))
            if best is None or ms < best[0]:
                best = (ms, t)
        except Exception as exc:  # noqa: BLE001 - a failing tiling is a result too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        print(f"  pallas {t}: " + (f"{row['us']} us, err {row['max_abs_err']:.3g}"
                                    if "us" in row else row["error"][:200]), flush=True)
    if best is not None:  # the winner and XLA once more, side by side
        one = functools.partial(skinny_gemm, t=best[1], interpret=args.smoke)
        (xm, _), (pm, _) = timed_interleaved([(gemm_chain(xla_gemm), (x, w), xla_ms),
                                              (gemm_chain(one), (x, w), best[0])], calls=10)
        rows.append(dict(base, impl="side_by_side", tiling=dataclasses.asdict(best[1]),
                         xla_us=round(xm * 1e3, 2), pallas_us=round(pm * 1e3, 2),
                         pallas_over_xla=round(pm / xm, 3)))
        print(f"  best {best[1]}: pallas {pm * 1e3:.2f} us vs xla {xm * 1e3:.2f} us "
              f"({pm / xm:.2f}x)", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
    p.add_argument("--xla-only", action="store_true", help="time XLA's dot only")
    p.add_argument("--shapes", default=None, help="comma-separated shape names")
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--out", default="bench/results/dense-gemm-h200.json")
    args = p.parse_args(argv)
    deadline = time.perf_counter() + args.budget_s
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    tbps = 1.0 if args.smoke else common.copy_bandwidth_tbps()
    rows = []
    for name, m, k, n in shapes:
        rows += run_shape(name, m, k, n, args, tbps, deadline)
    doc = dict(machine=common.machine_info(), command=common.command_line(),
               xla_flags=os.environ.get("XLA_FLAGS", ""), copy_tbps=tbps, rows=rows)
    common.write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
