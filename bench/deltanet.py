"""Gated DeltaNet's token mixer in XLA against its floors (issue 41, point 3: Pallas kernels
for the delta rule, "or XLA where it is measured to be as fast").

    python -m bench.deltanet --out bench/results/deltanet-h200.json
    python -m bench.deltanet --smoke          # tiny shapes on the CPU, arguments and plumbing

Qwen3.6-35B-A3B's DeltaNet layer shapes (16 key heads, 32 value heads, 128 x 128 state per
value head, float32 state as the engine keeps it). Per case, the median ms of one layer's op
(``bench.kernels.timed_interleaved``) and what bounds it:

* ``decode`` (the engine's step, T = 1): gather B rows' states from a slot pool, one
  recurrent step (``delta_rule.recurrent``), scatter them back into the donated pool. Floor:
  the state read once and written once, 2 * B * 32 * 128 * 128 * 4 bytes, at the measured
  copy bandwidth. A kernel cannot beat the copy of the state it must read and write, so the
  ratio time / floor says how much any Pallas kernel could win.
* ``decode-nogather``: the recurrent step on a [B, ...] state alone (no pool), the same floor:
  what the slot gather/scatter costs.
* ``prefill`` (T tokens of one sequence, ``delta_rule.chunked``, chunk 64): useful FLOPs per
  token and value head ~ 2 * (4 * Dk * Dv + 2 * C * (Dk + Dv)) (state read for u and o, the
  state update, the in-chunk products), reported as TFLOP/s against the measured bf16 matmul
  rate (these einsums run in float32, so XLA uses TF32 at best: half the bf16 rate is the
  realistic ceiling).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from bench import common
from bench.kernels import copy_tbps, timed_interleaved
from jfp8kv.kernels import delta_rule

SHAPES = dict(hk=16, hv=32, dk=128, dv=128)
SMOKE_SHAPES = dict(hk=2, hv=4, dk=16, dv=16)


def _inputs(b: int, t: int, s: dict, key):
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (b, t, s["hk"], s["dk"]), jnp.bfloat16)
    k = delta_rule.l2norm(jax.random.normal(ks[1], (b, t, s["hk"], s["dk"]), jnp.float32))
    v = jax.random.normal(ks[2], (b, t, s["hv"], s["dv"]), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, s["hv"]), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, s["hv"]), jnp.float32))
    return q, k.astype(jnp.bfloat16), v, g, beta


def decode_op(with_pool: bool):
    """reps -> jitted f(pool_or_state, slots, q, k, v, g, beta) running reps decode steps."""
    def make(reps):
        @functools.partial(jax.jit, donate_argnums=0)
        def f(pool, slots, q, k, v, g, beta):
            for _ in range(reps):
                state = pool[slots] if with_pool else pool
                out, state = delta_rule.recurrent(q, k, v, g, beta, state)
                pool = pool.at[slots].set(state) if with_pool else state
                q = q + 1e-3 * out[:, :, : q.shape[2], : q.shape[3]].astype(q.dtype)
            return pool
        return f
    return make


def prefill_op(reps):
    @jax.jit
    def f(state, q, k, v, g, beta):
        acc = jnp.zeros((), jnp.float32)
        for _ in range(reps):
            out, s = delta_rule.chunked(q, k, v, g, beta, state)
            acc = acc + out[0, -1, 0, 0].astype(jnp.float32) + s[0, 0, 0, 0]
            state = state + 1e-6 * acc
        return acc
    return f


def _timed_donating(make, args, est_ms):
    """timed_interleaved for an op that donates its first argument: each call gets the last
    call's output back as that argument."""
    holder = {"pool": args[0]}

    def fn(reps):
        f = make(reps)

        def call(*rest):
            holder["pool"] = f(holder["pool"], *rest)
            return holder["pool"]
        return call
    return timed_interleaved([(fn, args[1:], est_ms)])[0]


def run(smoke: bool, batches, tokens, slots_total: int) -> dict:
    s = SHAPES if not smoke else SMOKE_SHAPES
    state_bytes = s["hv"] * s["dk"] * s["dv"] * 4
    bw = copy_tbps(smoke)
    tflops = common.matmul_tflops(256 if smoke else 8192)
    rows = []
    for b in batches:
        q, k, v, g, beta = _inputs(b, 1, s, jax.random.key(b))
        slots = jnp.arange(1, b + 1, dtype=jnp.int32)
        floor_ms = 2 * b * state_bytes / (bw * 1e12) * 1e3
        for name, with_pool in (("decode", True), ("decode-nogather", False)):
            n = slots_total if with_pool else b
            pool = jnp.zeros((n, s["hv"], s["dk"], s["dv"]), jnp.float32)
            ms, reps = _timed_donating(decode_op(with_pool), (pool, slots, q, k, v, g, beta),
                                       est_ms=max(floor_ms, 0.01))
            rows.append(dict(case=name, batch=b, ms=ms, reps=reps, floor_ms=floor_ms,
                             over_floor=ms / floor_ms,
                             state_tbps=2 * b * state_bytes / (ms * 1e-3) / 1e12))
            print(rows[-1], flush=True)
    for t in tokens:
        q, k, v, g, beta = _inputs(1, t, s, jax.random.key(t))
        state = jnp.zeros((1, s["hv"], s["dk"], s["dv"]), jnp.float32)
        c = 64
        flops = t * s["hv"] * 2 * (4 * s["dk"] * s["dv"] + 2 * c * (s["dk"] + s["dv"]))
        (ms, reps), = timed_interleaved([(prefill_op, (state, q, k, v, g, beta), 1.0)])
        rows.append(dict(case="prefill", tokens=t, ms=ms, reps=reps, flops=flops,
                         tflops=flops / (ms * 1e-3) / 1e12, bf16_matmul_tflops=tflops))
        print(rows[-1], flush=True)
    return dict(shapes=s, state_bytes_per_seq_layer=state_bytes, copy_tbps=bw,
                matmul_tflops=tflops, rows=rows)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.deltanet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--slots", type=int, default=160, help="slot pool size of the decode case")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    tokens = [int(x) for x in args.tokens.split(",")]
    if args.smoke:
        batches, tokens = [2], [128]
    doc = dict(machine=common.machine_info(),
               command=common.command_line("bench.deltanet", list(argv)) if argv
               else common.command_line(),
               **run(args.smoke, batches, tokens, max(args.slots, max(batches) + 1)))
    if args.out:
        common.write_result(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
