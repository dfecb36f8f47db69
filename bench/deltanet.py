"""Gated DeltaNet's token mixer against its floors: XLA, the in-place decode kernel and jla's
Hopper prefill kernel side by side (issue 41, point 3; issue 56).

    python -m bench.deltanet --out bench/results/deltanet-h200.json
    python -m bench.deltanet --cases decode,decode-inplace --batches 32,128 --out /tmp/d.json
    python -m bench.deltanet --smoke          # tiny shapes on the CPU, arguments and plumbing

The cases of one group run side by side at each size (``timed_interleaved``: one call of
every case in turn, so a drift of the clocks hits them alike): ``decode`` and
``decode-inplace`` (one row per ``--block-v``) at each batch; ``prefill`` and
``prefill-jla`` at each token count. A case that cannot run here (jla off a Hopper GPU, or
not installed) writes a row with ``skipped`` and the reason instead of failing the run.

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
* ``decode-inplace``: the same steps through ``delta_decode.recurrent_step`` (Pallas Triton;
  interpret mode off the GPU): each row's state read from its slot and written back in place,
  same floor. Each decode row records ``pool_copies``: copies of a pool-sized buffer in the
  optimized program (0 is the point of the kernel).
* ``decode-nogather``: the recurrent step on a [B, ...] state alone (no pool), the same floor:
  what the slot gather/scatter costs.
* ``prefill`` (T tokens of one sequence, ``delta_rule.chunked``, chunk 64): useful FLOPs per
  token and value head ~ 2 * (4 * Dk * Dv + 2 * C * (Dk + Dv)) (state read for u and o, the
  state update, the in-chunk products), reported as TFLOP/s against the measured bf16 matmul
  rate (these einsums run in float32, so XLA uses TF32 at best: half the bf16 rate is the
  realistic ceiling).
* ``prefill-jla``: the same call through ``delta_prefill.chunked(impl="jla")`` (jla's Mosaic
  GPU kernel, bf16 tensor-core products), the same FLOP count.
* ``prefill-triton``: the candidate ``delta_chunk_triton.chunked`` (XLA's chunk factors, one
  Triton kernel walking the chunks), one row per ``--triton`` tuning (block_v:precision).
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
from jfp8kv.kernels import delta_chunk_triton, delta_decode, delta_prefill, delta_rule

SHAPES = dict(hk=16, hv=32, dk=128, dv=128)
SMOKE_SHAPES = dict(hk=2, hv=4, dk=16, dv=16)
# In the default order: the measurements that decide first (the engine's decode step and the
# in-place kernel against their floor, the chunked prefill in XLA and jla), then what the slot
# gather/scatter costs. Cases of one group are timed side by side at each size.
CASES = ("decode", "decode-inplace", "prefill", "prefill-jla", "prefill-triton",
         "decode-nogather")
GROUP = {"decode": "decode", "decode-inplace": "decode", "prefill": "prefill",
         "prefill-jla": "prefill", "prefill-triton": "prefill",
         "decode-nogather": "decode-nogather"}
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
    def one(pool, slots, q, k, v, g, beta):
        state = pool[slots] if with_pool else pool
        out, state = delta_rule.recurrent(q, k, v, g, beta, state)
        return out, pool.at[slots].set(state) if with_pool else state
    return _looped(one)


def inplace_decode_op(tuning: delta_decode.DeltaDecodeTuning, interpret: bool):
    """``decode_op(True)``'s loop with ``delta_decode.recurrent_step`` as the step: the same
    arguments (T = 1 axes), the pool donated and updated in place by the kernel."""
    def one(pool, slots, q, k, v, g, beta):
        out, pool = delta_decode.recurrent_step(pool, slots, q[:, 0], k[:, 0], v[:, 0],
                                                g[:, 0], beta[:, 0], interpret=interpret,
                                                tuning=tuning)
        return out[:, None], pool
    return _looped(one)


def _looped(one):
    def make(reps):
        @functools.partial(jax.jit, donate_argnums=0)
        def f(pool, slots, q, k, v, g, beta):
            def step(_, carry):
                pool, q = carry
                out, pool = one(pool, slots, q, k, v, g, beta)
                q = q + 1e-3 * out[:, :, : q.shape[2], : q.shape[3]].astype(q.dtype)
                return pool, q
            return jax.lax.fori_loop(0, reps, step, (pool, q), unroll=math.gcd(reps, UNROLL))[0]
        return f
    return make


def prefill_op(impl="xla"):
    """reps -> jitted f(state, q, k, v, g, beta) running ``delta_prefill.chunked`` (chunk 64,
    ``impl``; or ``impl`` itself when it is a function of the same contract) reps times in a
    loop (one copy in the program), each run's state fed from the last run's outputs."""
    fn = impl if callable(impl) else functools.partial(delta_prefill.chunked, impl=impl)

    def make(reps):
        @jax.jit
        def f(state, q, k, v, g, beta):
            def rep(_, carry):
                state, acc = carry
                out, s = fn(q, k, v, g, beta, state)
                acc = acc + out[0, -1, 0, 0].astype(jnp.float32) + s[0, 0, 0, 0]
                return state + 1e-6 * acc, acc
            return jax.lax.fori_loop(0, reps, rep, (state, jnp.zeros((), jnp.float32)))[1]
        return f
    return make


def _donating(make, args, est_ms):
    """A ``timed_interleaved`` job for an op that donates its first argument: each call gets
    the last call's output back as that argument (its own, per job)."""
    holder = {"pool": args[0]}

    def fn(reps):
        f = make(reps)

        def call(*rest):
            holder["pool"] = f(holder["pool"], *rest)
            return holder["pool"]
        return call
    return fn, args[1:], est_ms


def pool_copies(make, args) -> int:
    """Copies of a buffer of the pool's shape in the optimized program of ``make(1)``."""
    text = make(1).lower(*args).compile().as_text()
    shape = "[" + ",".join(str(d) for d in args[0].shape) + "]"
    return sum(1 for ln in text.splitlines()
               if " copy(" in ln and shape in ln.split(" copy(")[0])


def decode_rows(cases, b: int, s: dict, bw: float, slots_total: int, block_vs=(64,),
                pool_dtype: str = "float32") -> list[dict]:
    """The decode cases of ``cases`` at batch b, timed side by side, against the state's
    read+write floor at ``bw`` TB/s (``decode-inplace``: one row per block_v)."""
    state_bytes = s["hv"] * s["dk"] * s["dv"] * jnp.dtype(pool_dtype).itemsize
    q, k, v, g, beta = _inputs(b, 1, s, jax.random.key(b))
    slots = jnp.arange(1, b + 1, dtype=jnp.int32)
    floor_ms = 2 * b * state_bytes / (bw * 1e12) * 1e3
    interpret = jax.default_backend() != "gpu"
    jobs, labels = [], []
    for case in cases:
        with_pool = case != "decode-nogather"
        shape = (slots_total if with_pool else b, s["hv"], s["dk"], s["dv"])
        variants = ([(dict(block_v=bv), inplace_decode_op(delta_decode.DeltaDecodeTuning(
            block_v=bv), interpret)) for bv in block_vs] if case == "decode-inplace"
            else [({}, decode_op(with_pool))])
        for extra, make in variants:
            args = (jnp.zeros(shape, pool_dtype), slots, q, k, v, g, beta)
            copies = pool_copies(make, args) if with_pool else None
            jobs.append(_donating(make, args, est_ms=max(floor_ms, 0.01)))
            labels.append(dict(case=case, batch=b, **extra, pool_dtype=pool_dtype,
                               pool_copies=copies))
    rows = []
    for label, (ms, reps) in zip(labels, timed_interleaved(jobs)):
        rows.append(dict(label, ms=ms, reps=reps, floor_ms=floor_ms, over_floor=ms / floor_ms,
                         state_tbps=2 * b * state_bytes / (ms * 1e-3) / 1e12))
    return rows


PREFILL_IMPL = {"prefill": "xla", "prefill-jla": "jla"}


def flops_per_token_head(dk: int, dv: int, chunk: int = 64) -> int:
    """Useful FLOPs of the gated delta rule per token and value head in chunks of ``chunk``
    tokens: 2 * (4 * Dk * Dv + 2 * C * (Dk + Dv)) (the module docstring's count); chunk 0
    gives the recurrent step's. ``bench.offline``'s ideal model counts the same."""
    return 2 * (4 * dk * dv + 2 * chunk * (dk + dv))


def prefill_rows(cases, t: int, s: dict, tflops: float, chunk: int = 64,
                 triton_tunings=(delta_chunk_triton.ChunkTuning(),)) -> list[dict]:
    """The prefill cases of ``cases`` on one sequence of t tokens, timed side by side: ms and
    useful TFLOP/s (``prefill-triton``: one row per tuning). A case whose impl cannot take
    the call here gets a ``skipped`` row."""
    q, k, v, g, beta = _inputs(1, t, s, jax.random.key(t))
    state = jnp.zeros((1, s["hv"], s["dk"], s["dv"]), jnp.float32)
    args = (state, q, k, v, g, beta)
    flops = t * s["hv"] * flops_per_token_head(s["dk"], s["dv"], chunk)
    interpret = jax.default_backend() != "gpu"
    rows, jobs = [], []
    for case in cases:
        row = dict(case=case, tokens=t, flops=flops, bf16_matmul_tflops=tflops)
        if case == "prefill-triton":
            for tu in triton_tunings:
                fn = functools.partial(delta_chunk_triton.chunked, chunk=chunk,
                                       interpret=interpret, tuning=tu)
                rows.append(dict(row, impl="triton", block_v=tu.block_v,
                                 precision=tu.precision))
                jobs.append((rows[-1], (prefill_op(fn), args, 1.0)))
            continue
        impl = PREFILL_IMPL[case]
        row["impl"] = impl
        if impl != "xla":
            reason = delta_prefill.jla_unsupported_reason(q, k, v, g, beta, state)
            if reason is not None:
                rows.append(dict(row, skipped=reason))
                continue
        rows.append(row)
        jobs.append((row, (prefill_op(impl), args, 1.0)))
    for (row, _), (ms, reps) in zip(jobs, timed_interleaved([j for _, j in jobs])):
        row.update(ms=ms, reps=reps, tflops=flops / (ms * 1e-3) / 1e12)
    return rows


def _groups(cases):
    """The groups of ``cases`` in the order they first appear, each with its cases in order."""
    out: dict[str, list[str]] = {}
    for c in cases:
        out.setdefault(GROUP[c], []).append(c)
    return list(out.items())


def _versions() -> dict:
    from importlib import metadata

    v = {}
    for name in ("jax-linear-attention", "jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            v[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return v


def run(smoke: bool, cases, batches, tokens, slots_total: int, emit=print, block_vs=(64,),
        pool_dtype: str = "float32", triton_tunings=(delta_chunk_triton.ChunkTuning(),)) -> dict:
    """Every group of ``cases`` in order (decode groups per batch, prefill per token count),
    the cases of a group side by side; ``emit(doc)`` after each size, its rows' ``wall_s``
    the size's wall time including the compiles."""
    s = SHAPES if not smoke else SMOKE_SHAPES
    bw = copy_tbps(smoke) if any(GROUP[c] != "prefill" for c in cases) else None
    tflops = common.matmul_tflops(256 if smoke else 8192) if any(
        GROUP[c] == "prefill" for c in cases) else None
    doc = dict(shapes=s, state_bytes_per_seq_layer=s["hv"] * s["dk"] * s["dv"]
               * jnp.dtype(pool_dtype).itemsize,
               pool_dtype=pool_dtype, copy_tbps=bw, matmul_tflops=tflops, cases=list(cases),
               block_v=list(block_vs), packages=_versions(),
               triton=[f"{t.block_v}:{t.precision}" for t in triton_tunings], rows=[])
    for group, members in _groups(cases):
        for x in tokens if group == "prefill" else batches:
            t0 = time.perf_counter()
            rows = (prefill_rows(members, x, s, tflops, triton_tunings=triton_tunings)
                    if group == "prefill"
                    else decode_rows(members, x, s, bw, slots_total, block_vs, pool_dtype))
            for row in rows:
                row["wall_s"] = round(time.perf_counter() - t0, 3)
            doc["rows"].extend(rows)
            emit(doc, len(rows))
    return doc


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.deltanet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma list, run in this order (default: {','.join(CASES)})")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--tokens", default="2048,8192,32768")
    p.add_argument("--slots", type=int, default=160, help="slot pool size of the decode case")
    p.add_argument("--block-v", default="32,64,128",
                   help="decode-inplace: value columns per program, one row each")
    p.add_argument("--triton", default="32:tf32,32:bf16,64:bf16",
                   help="prefill-triton: block_v:precision per row (precision ieee|tf32|bf16)")
    p.add_argument("--pool-dtype", default="float32", choices=list(delta_decode.POOL_DTYPES),
                   help="the decode cases' state pool (the engine's default: float32)")
    p.add_argument("--out", default=None, help="JSON, rewritten after every row")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = sorted(set(cases) - set(CASES))
    if bad or not cases:
        p.error(f"--cases: unknown {bad}; choose from {list(CASES)}")
    batches = [int(x) for x in args.batches.split(",")]
    tokens = [int(x) for x in args.tokens.split(",")]
    block_vs = [int(x) for x in args.block_v.split(",")]
    tunings = [delta_chunk_triton.ChunkTuning(block_v=int(bv), precision=pr)
               for bv, pr in (x.split(":") for x in args.triton.split(","))]
    if args.smoke:
        batches, tokens, block_vs, tunings = [2], [128], block_vs[:1], tunings[:1]
    head = dict(machine=common.machine_info(),
                command=common.command_line("bench.deltanet", list(argv)) if argv
                else common.command_line(), complete=False)

    def emit(doc, n=1):  # a run cut short by a time limit keeps the rows it finished
        for row in doc["rows"][-n:]:
            print(row, flush=True)
        if args.out:
            common.write_result(args.out, {**head, **doc})

    doc = {**head, **run(args.smoke, cases, batches, tokens, max(args.slots, max(batches) + 1),
                         emit, block_vs, args.pool_dtype, tunings), "complete": True}
    if args.out:
        common.write_result(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
