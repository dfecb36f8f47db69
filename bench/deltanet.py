"""Gated DeltaNet's token mixer in XLA against its floors (issue 41, point 3: Pallas kernels
for the delta rule, "or XLA where it is measured to be as fast").

    python -m bench.deltanet --out bench/results/deltanet-h200.json
    python -m bench.deltanet --cases decode --batches 32,128 --out /tmp/d.json   # a subset
    python -m bench.deltanet --smoke          # tiny shapes on the CPU, arguments and plumbing

The JSON is rewritten after every row (``complete`` false until the last), so a run cut
short by a time limit keeps what it measured; each row's ``wall_s`` includes its compile.

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
import math
import time

import jax
import jax.numpy as jnp

from bench import common
from bench.kernels import copy_tbps, timed_interleaved
from jfp8kv.kernels import delta_rule

SHAPES = dict(hk=16, hv=32, dk=128, dv=128)
SMOKE_SHAPES = dict(hk=2, hv=4, dk=16, dv=16)
# In the default order: the measurements that decide first (the engine's decode step against
# its floor, the chunked prefill), then what the slot gather/scatter costs.
CASES = ("decode", "prefill", "decode-nogather")
UNROLL = 8  # decode steps per loop iteration (see decode_op)


def _inputs(b: int, t: int, s: dict, key):
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (b, t, s["hk"], s["dk"]), jnp.bfloat16)
    k = delta_rule.l2norm(jax.random.normal(ks[1], (b, t, s["hk"], s["dk"]), jnp.float32))
    v = jax.random.normal(ks[2], (b, t, s["hv"], s["dv"]), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, s["hv"]), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, s["hv"]), jnp.float32))
    return q, k.astype(jnp.bfloat16), v, g, beta


def decode_op(with_pool: bool):
    """reps -> jitted f(pool_or_state, slots, q, k, v, g, beta) running reps decode steps
    (pool donated; nothing static but reps). The steps are a loop whose body holds
    gcd(reps, UNROLL) of them, so the program and its compile do not grow with reps (they
    were unrolled up to 48 times per program before, six such programs a run) while one
    loop iteration still covers several steps. The carried pool is updated in place (the
    CPU's optimized HLO has no copy of it)."""
    def make(reps):
        @functools.partial(jax.jit, donate_argnums=0)
        def f(pool, slots, q, k, v, g, beta):
            def step(_, carry):
                pool, q = carry
                state = pool[slots] if with_pool else pool
                out, state = delta_rule.recurrent(q, k, v, g, beta, state)
                pool = pool.at[slots].set(state) if with_pool else state
                q = q + 1e-3 * out[:, :, : q.shape[2], : q.shape[3]].astype(q.dtype)
                return pool, q
            return jax.lax.fori_loop(0, reps, step, (pool, q), unroll=math.gcd(reps, UNROLL))[0]
        return f
    return make


def prefill_op(reps):
    """jitted f(state, q, k, v, g, beta) running ``delta_rule.chunked`` reps times in a
    loop (one copy in the program), each run's state fed from the last run's outputs."""
    @jax.jit
    def f(state, q, k, v, g, beta):
        def rep(_, carry):
            state, acc = carry
            out, s = delta_rule.chunked(q, k, v, g, beta, state)
            acc = acc + out[0, -1, 0, 0].astype(jnp.float32) + s[0, 0, 0, 0]
            return state + 1e-6 * acc, acc
        return jax.lax.fori_loop(0, reps, rep, (state, jnp.zeros((), jnp.float32)))[1]
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


def decode_row(case: str, b: int, s: dict, bw: float, slots_total: int) -> dict:
    """One decode case (``decode``: through the slot pool; ``decode-nogather``: the state
    alone) at batch b against the state's read+write floor at ``bw`` TB/s."""
    state_bytes = s["hv"] * s["dk"] * s["dv"] * 4
    q, k, v, g, beta = _inputs(b, 1, s, jax.random.key(b))
    slots = jnp.arange(1, b + 1, dtype=jnp.int32)
    floor_ms = 2 * b * state_bytes / (bw * 1e12) * 1e3
    with_pool = case == "decode"
    pool = jnp.zeros((slots_total if with_pool else b, s["hv"], s["dk"], s["dv"]), jnp.float32)
    ms, reps = _timed_donating(decode_op(with_pool), (pool, slots, q, k, v, g, beta),
                               est_ms=max(floor_ms, 0.01))
    return dict(case=case, batch=b, ms=ms, reps=reps, floor_ms=floor_ms,
                over_floor=ms / floor_ms, state_tbps=2 * b * state_bytes / (ms * 1e-3) / 1e12)


def prefill_row(t: int, s: dict, tflops: float, chunk: int = 64) -> dict:
    """The chunked prefill of one sequence of t tokens: its useful TFLOP/s."""
    q, k, v, g, beta = _inputs(1, t, s, jax.random.key(t))
    state = jnp.zeros((1, s["hv"], s["dk"], s["dv"]), jnp.float32)
    flops = t * s["hv"] * 2 * (4 * s["dk"] * s["dv"] + 2 * chunk * (s["dk"] + s["dv"]))
    (ms, reps), = timed_interleaved([(prefill_op, (state, q, k, v, g, beta), 1.0)])
    return dict(case="prefill", tokens=t, ms=ms, reps=reps, flops=flops,
                tflops=flops / (ms * 1e-3) / 1e12, bf16_matmul_tflops=tflops)


def run(smoke: bool, cases, batches, tokens, slots_total: int, emit=print) -> dict:
    """Every case of ``cases`` in order (each decode case per batch, prefill per token
    count); ``emit(row)`` after each row, its ``wall_s`` including the compile."""
    s = SHAPES if not smoke else SMOKE_SHAPES
    bw = copy_tbps(smoke) if any(c != "prefill" for c in cases) else None
    tflops = common.matmul_tflops(256 if smoke else 8192) if "prefill" in cases else None
    doc = dict(shapes=s, state_bytes_per_seq_layer=s["hv"] * s["dk"] * s["dv"] * 4,
               copy_tbps=bw, matmul_tflops=tflops, cases=list(cases), rows=[])
    for case in cases:
        for x in tokens if case == "prefill" else batches:
            t0 = time.perf_counter()
            row = (prefill_row(x, s, tflops) if case == "prefill"
                   else decode_row(case, x, s, bw, slots_total))
            row["wall_s"] = round(time.perf_counter() - t0, 3)
            doc["rows"].append(row)
            emit(doc)
    return doc


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.deltanet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma list, run in this order (default: {','.join(CASES)})")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--slots", type=int, default=160, help="slot pool size of the decode case")
    p.add_argument("--out", default=None, help="JSON, rewritten after every row")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = sorted(set(cases) - set(CASES))
    if bad or not cases:
        p.error(f"--cases: unknown {bad}; choose from {list(CASES)}")
    batches = [int(x) for x in args.batches.split(",")]
    tokens = [int(x) for x in args.tokens.split(",")]
    if args.smoke:
        batches, tokens = [2], [128]
    head = dict(machine=common.machine_info(),
                command=common.command_line("bench.deltanet", list(argv)) if argv
                else common.command_line(), complete=False)

    def emit(doc):  # a run cut short by a time limit keeps the rows it finished
        print(doc["rows"][-1], flush=True)
        if args.out:
            common.write_result(args.out, {**head, **doc})

    doc = {**head, **run(args.smoke, cases, batches, tokens,
                         max(args.slots, max(batches) + 1), emit), "complete": True}
    if args.out:
        common.write_result(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
