"""Kernel benchmark: paged decode attention, fused store and prefill on one GPU.

    python -m bench.kernels --out bench/results/kernels-h200.json [--sweep] [--smoke]

Writes {"machine", "versions", "command", "copy_tbps", "records": [...]} (rewritten after
every record, so a run cut short keeps what it measured) and a PNG next to it. Each record:
op, impl (jfp8kv, or jax_ops_paged_attention = jax.experimental.pallas.ops.gpu
.paged_attention run in this process), kv_cache_dtype, kv_scale_mode, batch, context or
tokens, ms (median over timed calls; each call runs the op `reps` times back to back in one
jitted, unrolled chain whose iterations depend on each other, so XLA cannot merge them and
host dispatch is amortized), tbps (bytes that must move / ms: K, V and scales read once, q
and the output; for the store the new rows read and the quantized rows and scales
written), plus the tuning used. ``--sweep`` first times decode code-generation variants
and launch knobs and uses the best; ``--sweep-prefill`` does the same for prefill (tile
shapes and warps, then stages and fp8 variants, per storage); ``--smoke`` runs tiny shapes
in interpret mode (CPU). ``--kv-rotation hadamard,smooth,smooth+hadamard`` (or ``all``) times
only the issue-14 K transform's cost: ``jfp8kv.kernels.store_kv`` / ``paged_attention`` (K's
transform runs there before the store kernel, the queries' inside the attention kernels)
for e4m3 token/block/tensor with kv_rotation none and each transform side by side, rows under "rotation" with ``ratio_vs_none``
and ``cost_pct``, "rotation_summary" (each op against its own time) and
"rotation_phase_summary", the issue's < 3% target: per phase, the extra time of the step's
store plus its attention over the attention time with kv_rotation none:

    python -m bench.kernels --kv-rotation all [--rotation-ops decode,prefill,store] \
        [--budget-s 400] --out bench/results/kernels-h200.json
Data is random (never zeros); every K/V byte a sequence can see is distinct data.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jfp8kv.config import CacheConfig, ModelConfig
from jfp8kv.kernels import pallas_decode, pallas_prefill, pallas_store
from jfp8kv.kernels.prologue import QKPrologue, rope_tables
from jfp8kv.kvcache.cache import LayerKV, reduce_stat_rows
from jfp8kv.models.presets import PRESETS
from jfp8kv.models.transformer import rope_inv_freq

def _jaxlib_version() -> str:
    import jaxlib

    return getattr(jaxlib, "__version__", "?")


USER_NAME = {"bfloat16": "bf16", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


def timed(fn, *args, est_ms: float, calls: int = 10, target_ms: float = 4.0,
          max_reps: int = 48):
    """Median ms per op. ``fn(reps)`` returns a jitted f(*args) running the op reps times;
    reps is chosen from the estimate so one timed call lasts about ``target_ms``."""
    return timed_interleaved([(fn, args, est_ms)], calls, target_ms, max_reps)[0]


def timed_interleaved(jobs, calls: int = 10, target_ms: float = 4.0, max_reps: int = 48):
    """``timed`` for ops compared side by side: each job (fn, args, est_ms) is compiled and
    warmed, then ``calls`` rounds time one call of every job in turn, so a drift of the
    GPU's clocks or load hits every op alike. -> [(median ms per op, reps), ...]."""
    runs = []
    for fn, args, est_ms in jobs:
        reps = int(min(max_reps, max(2, target_ms / max(est_ms, 1e-3))))
        f = fn(reps)
        jax.block_until_ready(f(*args))  # compile + warm-up
        jax.block_until_ready(f(*args))
        runs.append((f, args, reps, []))
    for _ in range(calls):
        for f, args, reps, samples in runs:
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            samples.append((time.perf_counter() - t) * 1e3 / reps)
    return [(statistics.median(samples), reps) for _, _, reps, samples in runs]


def copy_tbps(smoke: bool) -> float:
    n = (1 << 16) if smoke else (1 << 30)  # 4 GiB of f32 on the GPU
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)  # one read + one write per element
    jax.block_until_ready(f(x))
    samples = []
    for _ in range(5):  # 10 back-to-back launches per sample: host sync amortized
        t = time.perf_counter()
        ys = [f(x) for _ in range(10)]
        jax.block_until_ready(ys)
        samples.append((time.perf_counter() - t) / 10)
        del ys
    return 2 * n * 4 / statistics.median(samples) / 1e12


# ----------------------------------------------------------------------------- data


def make_layer(rng, cfg: CacheConfig, batch: int, context: int):
    """Pages filled with random data; page tables give each sequence its own shuffled pages."""
    h, s, d = cfg.num_kv_heads, cfg.page_size, cfg.head_dim
    mp = -(-context // s)
    p = cfg.num_pages
    key = jax.random.key(int(rng.integers(1 << 30)))
    kk, kv, ks, kvs = jax.random.split(key, 4)
    dt = jnp.dtype(cfg.storage_dtype)

    def pages(k):
        x = jax.random.normal(k, (h, p, s, d), jnp.float32)
        if cfg.is_fp8:
            x = jnp.clip(x * 60.0, -400, 400)
        return x.astype(dt)

    def scales(k):
        if not cfg.is_fp8:
            return jnp.ones((0,), jnp.float32)
        if cfg.scale_mode in ("tensor", "channel"):  # tensor: one per head (the policy's)
            width = d if cfg.scale_mode == "channel" else 1
            return jnp.broadcast_to(jax.random.uniform(k, (h, width), jnp.float32, 0.005,
                                                       0.02), (h, d))
        if cfg.scale_mode == "token":
            return jax.random.uniform(k, (h, p, s), jnp.float32, 0.005, 0.02)
        return jax.random.uniform(k, (h, p, s, d // 32), jnp.float32, 0.005, 0.02).astype(
            jnp.float16)

    layer = LayerKV(pages(kk), pages(kv), scales(ks), scales(kvs))
    perm = rng.permutation(np.arange(1, p))[: batch * mp].reshape(batch, mp)
    return layer, jnp.asarray(perm, jnp.int32), jnp.full((batch,), context, jnp.int32)


def kv_bytes(cfg: CacheConfig, tokens: int) -> int:
    """K+V bytes (and scales) that must be read for ``tokens`` cached tokens."""
    item = jnp.dtype(cfg.storage_dtype).itemsize
    per = cfg.num_kv_heads * cfg.head_dim * item
    if cfg.is_fp8 and cfg.scale_mode == "token":
        per += cfg.num_kv_heads * 4
    if cfg.is_fp8 and cfg.scale_mode == "block":
        per += cfg.num_kv_heads * (cfg.head_dim // 32) * 2
    extra = 2 * cfg.num_kv_heads * cfg.head_dim * 4 if cfg.is_fp8 and cfg.scale_mode in (
        "tensor", "channel") else 0
    return 2 * per * tokens + extra


def cache_cfg(storage, mode, hkv, d, num_pages, page_size=16):
    return CacheConfig(num_layers=1, num_kv_heads=hkv, head_dim=d, num_pages=num_pages,
                       page_size=page_size, storage_dtype=storage,
                       scale_mode=mode if storage.startswith("float8") else None)


# ----------------------------------------------------------------------------- ops


def chain(one):
    """reps -> jitted f(q, *rest) calling ``out = one(q, *rest)`` reps times, each call
    depending on the last (q_{i+1} = q_i + 1e-3 out_i, ``out`` zero-padded to q's last
    dimension when narrower) so XLA cannot merge them; returns the f32 sum of the outputs."""
    def make(reps):
        @jax.jit
        def f(q, *rest):
            acc = 0.0
            for _ in range(reps):
                out = one(q, *rest).astype(jnp.float32)
                acc = acc + out
                step = jnp.pad(out, [(0, 0)] * (q.ndim - 1) + [(0, q.shape[-1] - out.shape[-1])])
                q = (q.astype(jnp.float32) + 1e-3 * step).astype(q.dtype)
            return acc
        return f
    return make


def decode_chain(kind: str, cfg: CacheConfig, tuning, interpret: bool):
    """reps -> jitted (q, layer, pt, lens) running decode reps times (``chain``)."""
    sm = 1.0 / float(np.sqrt(cfg.head_dim))

    def one(q, layer, pt, lens):
        if kind == "jfp8kv":
            return pallas_decode.decode_attention(q, layer, pt, lens, cfg, sm,
                                                  interpret=interpret, tuning=tuning)
        if kind == "mosaic":
            from lab import mosaic_decode

            return mosaic_decode.decode_attention(q, layer, pt, lens, cfg, sm,
                                                  interpret=interpret, tuning=tuning)
        if kind == "mosaic_t":
            from lab import mosaic_decode_t

            return mosaic_decode_t.decode_attention(q, layer, pt, lens, cfg, sm,
                                                    interpret=interpret, tuning=tuning)
        from jax.experimental.pallas.ops.gpu import paged_attention as jpa

        scales = (layer.k_scale, layer.v_scale) if cfg.is_fp8 else (None, None)
        return jpa.paged_attention(q * sm, layer.k, layer.v, pt, lens, *scales,
                                   interpret=interpret)

    return chain(one)


def store_chain(cfg: CacheConfig, interpret: bool, fp8_cast: str = "auto", pro=None):
    """reps -> jitted f(layer, k, v, slots) -> (layer, stats) storing reps times; the calls'
    stats rows are reduced once at the end, as the model reduces its layers' (so no row
    pays a per-call reduction the engine does not run). ``pro`` (a ``QKPrologue``): the
    engine's fused store instead, ``k`` then being the raw qkv heads [N, H + 2 Hkv, D]
    (``v`` unused); each call's queries feed the result."""
    def store(layer, k, v, slots):
        if pro is None:
            layer, rows = pallas_store.store_kv(layer, k, v, slots, cfg, interpret=interpret,
                                                fp8_cast=fp8_cast, stat_rows=True)
            return layer, rows, None
        q, layer, rows = pallas_store.prologue_store(k, pro, layer, slots, cfg, stat_rows=True,
                                                     interpret=interpret, fp8_cast=fp8_cast)
        return layer, rows, q[0, 0, 0].astype(jnp.float32)

    def make(reps):
        @functools.partial(jax.jit, donate_argnums=(0,))
        def f(layer, k, v, slots):
            rows, qs = [], []
            for _ in range(reps):
                layer, r, q = store(layer, k, v, slots)
                rows.append(r)
                qs.append(jnp.zeros((), jnp.float32) if q is None else q)
            return layer, reduce_stat_rows(jnp.concatenate(rows)) + jnp.sum(jnp.stack(qs))
        return f
    return make


def prologue_inputs(tokens: int, d: int) -> QKPrologue:
    """The fused store's prologue as a Qwen3-8B layer hands it over (head_dim ``d``): RoPE
    tables for positions 0..tokens-1 from the model's own frequencies, and q/k norm weights
    near 1."""
    cfg = dataclasses.replace(ModelConfig(**PRESETS["qwen3-8b"]), head_dim=d)
    cos, sin = rope_tables(jnp.arange(tokens, dtype=jnp.int32),
                           jnp.asarray(rope_inv_freq(cfg)))
    w = 1 + 0.1 * jax.random.normal(jax.random.key(5), (2, d), jnp.float32)
    return QKPrologue(cos, sin, w[0].astype(jnp.bfloat16), w[1].astype(jnp.bfloat16), 1e-6)


def prefill_chain(cfg: CacheConfig, tuning, interpret: bool, kind: str = "jfp8kv"):
    """reps -> jitted (q, layer, pt, lens, pos) running prefill reps times (``chain``);
    ``kind`` "jfp8kv" (the Triton kernel) or "mosaic" (``kernels.mosaic_prefill``)."""
    sm = 1.0 / float(np.sqrt(cfg.head_dim))
    if kind == "mosaic":
        from jfp8kv.kernels import mosaic_prefill as impl
    else:
        impl = pallas_prefill
    return chain(lambda q, layer, pt, lens, pos: impl.prefill_attention(
        q, layer, pt, lens, pos, cfg, sm, interpret=interpret, tuning=tuning))


# ----------------------------------------------------------------------------- runner


class Bench:
    def __init__(self, out_path: str, smoke: bool):
        self.out_path, self.smoke = out_path, smoke
        self.interpret = smoke
        self.calls = 10
        self.rng = np.random.default_rng(0)
        dev = jax.devices()[0]
        self.doc = {
            "machine": f"{getattr(dev, 'device_kind', dev.platform)} ({platform.node()})",
            "versions": {"jax": jax.__version__, "jaxlib": _jaxlib_version(),
                         "python": platform.python_version()},
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "copy_tbps": None,
            "records": [],
            "sweep": [],
        }

    def save(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.out_path)), exist_ok=True)
        with open(self.out_path, "w") as fh:
            json.dump(self.doc, fh, indent=1)

    def add(self, rec, where="records"):
        self.doc[where].append(rec)
        self.save()
        keys = ("op", "impl", "kv_cache_dtype", "kv_scale_mode", "kv_rotation", "batch",
                "context", "tokens", "num_heads", "head_dim", "fp8_cast", "ms", "tbps",
                "ratio_vs_bf16", "ratio_vs_none", "cost_pct", "tuning", "error")
        print(" ".join(f"{k}={rec[k]}" for k in keys if k in rec), flush=True)

    def decode(self, impl, storage, mode, batch, context, hq, hkv, d, tuning=None,
               where="records", page_size=16):
        rec = dict(op="decode_attention", impl=impl,
                   kv_cache_dtype=USER_NAME.get(storage, storage), kv_scale_mode=mode,
                   batch=batch, context=context, num_heads=hq, num_kv_heads=hkv, head_dim=d)
        if tuning is not None:
            rec["tuning"] = dataclasses.asdict(tuning)
        if page_size != 16:
            rec["page_size"] = page_size
        try:
            s = page_size
            cfg = cache_cfg(storage, mode, hkv, d, 1 + batch * (-(-context // s)), s)
            layer, pt, lens = make_layer(self.rng, cfg, batch, context)
            q = jax.random.normal(jax.random.key(1), (batch, hq, d), jnp.bfloat16)
            moved = kv_bytes(cfg, batch * context) + 2 * q.size * 2 + pt.size * 4
            ms, reps = timed(decode_chain(impl, cfg, tuning, self.interpret), q, layer, pt, lens,
                             est_ms=moved / 2e9, calls=3 if self.smoke else self.calls)
            rec.update(ms=round(ms, 5), tbps=round(moved / ms / 1e9, 4), bytes=moved, reps=reps)
            del layer
        except Exception as e:  # noqa: BLE001 - a failed variant is recorded, not fatal
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        self.add(rec, where)
        return rec

    def store(self, storage, mode, tokens, hkv=8, d=128, fp8_cast="auto", where="records",
              hq=None):
        """One store row; ``hq`` (query heads): the engine's fused prologue store (q/k RMS
        norm + RoPE + store, ``pallas_store.prologue_store``) instead of the plain one."""
        return self.store_group([dict(storage=storage, mode=mode, tokens=tokens, hkv=hkv, d=d,
                                      fp8_cast=fp8_cast, hq=hq)], where)[0]

    def store_group(self, specs, where="records"):
        """Store rows (``store``'s arguments as dicts) timed side by side
        (``timed_interleaved``); a row that fails to build records its error."""
        built = [self._store_job(**spec) for spec in specs]
        jobs = [job for _, job in built if job is not None]
        try:
            times = iter(timed_interleaved(
                [(fn, args, est) for fn, args, est, _ in jobs], calls=3 if self.smoke else 20,
                max_reps=2 if self.smoke else 48))
        except Exception as e:  # noqa: BLE001
            times, err = None, f"{type(e).__name__}: {str(e)[:400]}"
        for rec, job in built:
            if job is not None and times is not None:
                ms, reps = next(times)
                moved = job[3]
                rec.update(ms=round(ms, 5), tbps=round(moved / ms / 1e9, 4), bytes=moved,
                           reps=reps)
            elif job is not None:
                rec["error"] = err
            self.add(rec, where)
        return [rec for rec, _ in built]

    def _store_job(self, storage, mode, tokens, hkv=8, d=128, fp8_cast="auto", hq=None):
        """(record, (fn, args, est_ms, bytes moved)) of one store row; (record with its
        error, None) when it cannot be built."""
        rec = dict(op="store" if hq is None else "prologue_store", impl="jfp8kv",
                   kv_cache_dtype=USER_NAME.get(storage, storage), kv_scale_mode=mode,
                   batch=1, tokens=tokens, num_kv_heads=hkv, head_dim=d, fp8_cast=fp8_cast)
        if hq is not None:
            rec["num_heads"] = hq
        try:
            s = 16
            p = 2 + 2 * tokens // s
            cfg = cache_cfg(storage, mode, hkv, d, p, s)
            layer, _, _ = make_layer(self.rng, cfg, 1, s)
            heads = hkv if hq is None else hq + 2 * hkv
            k = jax.random.normal(jax.random.key(2), (tokens, heads, d), jnp.bfloat16)
            v = jax.random.normal(jax.random.key(3), (tokens, hkv, d), jnp.bfloat16)
            slots = jnp.asarray(self.rng.permutation((p - 1) * s)[:tokens] + s, jnp.int32)
            pro = None if hq is None else prologue_inputs(tokens, d)
            make = store_chain(cfg, self.interpret, fp8_cast, pro)
            holder = {"layer": layer}

            def fn(reps):  # donation consumes the layer: thread it through the calls
                f = make(reps)

                def g(k, v, slots):
                    holder["layer"], tot = f(holder["layer"], k, v, slots)
                    return tot
                return g
            item = jnp.dtype(storage).itemsize
            sc = {"token": 4, "block": 2 * d // 32}.get(mode, 0) if cfg.is_fp8 else 0
            moved = 2 * tokens * hkv * (d * 2 + d * item + sc) + tokens * 4
            if hq is not None:  # queries read and written, the rotary tables read (f32)
                moved += 2 * tokens * hq * d * 2 + 2 * tokens * d * 4
            return rec, (fn, (k, v, slots), 0.004 + moved / 1e9, moved)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            return rec, None

    def prefill(self, storage, mode, batch, chunk, prefix, hq=32, hkv=8, d=128, tuning=None,
                where="records", impl="jfp8kv"):
        rec = dict(op="prefill_attention", impl=impl,
                   kv_cache_dtype=USER_NAME.get(storage, storage), kv_scale_mode=mode,
                   batch=batch, tokens=chunk, context=prefix + chunk, num_heads=hq,
                   num_kv_heads=hkv, head_dim=d)
        try:
            s = 16
            ctx = prefix + chunk
            cfg = cache_cfg(storage, mode, hkv, d, 1 + batch * (-(-ctx // s)), s)
            layer, pt, lens = make_layer(self.rng, cfg, batch, ctx)
            q = jax.random.normal(jax.random.key(4), (batch, chunk, hq, d), jnp.bfloat16)
            pos = jnp.broadcast_to(jnp.arange(prefix, ctx, dtype=jnp.int32), (batch, chunk))
            if impl == "jfp8kv":
                tuning = tuning or pallas_prefill.default_tuning(cfg)
            else:
                from jfp8kv.kernels.mosaic_prefill import MosaicPrefillTuning

                tuning = tuning or MosaicPrefillTuning()
            moved = kv_bytes(cfg, batch * ctx) + 2 * q.size * 2
            # causal: query i sees prefix + i + 1 keys
            flops = 4 * batch * hq * d * (chunk * prefix + chunk * (chunk + 1) / 2)
            ms, reps = timed(prefill_chain(cfg, tuning, self.interpret, impl), q, layer, pt,
                             lens, pos,
                             est_ms=flops / 2e11, calls=3 if self.smoke else 8)
            rec.update(ms=round(ms, 5), tbps=round(moved / ms / 1e9, 4),
                       tflops=round(flops / ms / 1e9, 2), reps=reps,
                       tuning=dataclasses.asdict(tuning))
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        self.add(rec, where)
        return rec


def pick_best(b: Bench, label: str, tunings, time_one, calls: int):
    """Time each tuning with ``time_one(tuning) -> [record, ...]`` (one per shape, at ``calls``
    timed calls each) and return the one with the lowest geometric-mean time."""
    scores = []
    b.calls = calls
    for t in tunings:
        ms = [r.get("ms", float("inf")) for r in time_one(t)]
        scores.append((float(np.exp(np.mean(np.log(ms)))), t))
    b.calls = 10
    best = min(scores, key=lambda x: x[0])
    print(f"best for {label}: {best[1]} ({best[0]:.4f} ms geo-mean)", flush=True)
    return best[1]


def sweep_decode(b: Bench, shapes, storage, mode, base: pallas_decode.DecodeTuning, grid):
    """Time each tuning in ``grid`` (dicts of overrides) on ``shapes``; return the best."""
    return pick_best(
        b, f"decode {storage}/{mode}", [dataclasses.replace(base, **over) for over in grid],
        lambda t: [b.decode("jfp8kv", storage, mode, batch, ctx, 32, 8, 128, t, where="sweep")
                   for batch, ctx in shapes], calls=6)


SMALL_DECODE_SHAPES = ((32, 640), (8, 640), (64, 1024))  # Qwen3-0.6B engine runs


def run_small_decode_sweep(b: Bench, smoke: bool) -> int:
    """Decode at short contexts with Qwen3-0.6B's heads (16 query / 8 KV, dim 128), where a
    step is latency- rather than bandwidth-bound: today's default per storage against finer
    tiles and more splits (more programs, each with less of the loop), and against fewer
    programs (one split, two stages). Records go to
    'sweep'; the best per storage is printed and kept under 'small_decode_best'."""
    shapes = SMALL_DECODE_SHAPES if not smoke else ((2, 64),)
    b.doc["copy_tbps"] = round(copy_tbps(smoke), 4)
    best = {}
    for storage, mode in (("bfloat16", None), ("float8_e4m3fn", "token")):
        base = pallas_decode.default_tuning(cache_cfg(storage, mode, 8, 128, 2))
        grid = [dict(block_k=bk, target_programs=tp) for bk in (base.block_k, 64, 32)
                for tp in (base.target_programs, 1056, 2112)]
        # fewer programs instead: one split (no combine pass; each program walks its whole
        # sequence, so the pipeline reaches a steady state) with 3 or 2 stages, or 264 targets
        grid += [dict(num_splits=1), dict(num_splits=1, num_stages=2),
                 dict(target_programs=264)]
        grid = list({tuple(g.items()): g for g in grid}.values())[: 2 if smoke else None]
        t = pick_best(b, f"small decode {storage}", [dataclasses.replace(base, **g) for g in grid],
                      lambda t: [b.decode("jfp8kv", storage, mode, batch, ctx, 16, 8, 128, t,
                                          where="sweep") for batch, ctx in shapes],
                      calls=3 if smoke else 10)
        best[storage] = dataclasses.asdict(t)
    b.doc["small_decode_best"] = best
    b.save()
    return 0


def sweep_prefill(b: Bench, shapes, storage, mode, grid):
    """Time each PrefillTuning in ``grid`` on ``shapes`` ((batch, chunk, prefix)); return the
    best."""
    return pick_best(
        b, f"prefill {storage}/{mode}", grid,
        lambda t: [b.prefill(storage, mode, *shape, tuning=t, where="sweep") for shape in shapes],
        calls=5)


def prefill_shapes_grid(smoke: bool):
    """Phase 1 of the prefill sweep: tile shapes and warps (2 stages, variant fixed)."""
    P = pallas_prefill.PrefillTuning
    if smoke:
        return [P(16, 16, 4, 2), P(32, 16, 4, 2)]
    grid = []
    for bm in (64, 128):
        for bk in (32, 64, 128):
            for nw in (4, 8):
                if bm * bk >= 128 * 128 and nw == 4:
                    continue  # a 128x128 f32 score tile in 4 warps spills
                grid.append(P(bm, bk, nw, 2))
    return grid


# Prefill variants worth timing: "asm" is left out, as for prefill it compiles to the same PTX
# as a plain astype (bench.ptx_stats); "rowscale" only changes token scales.
PREFILL_VARIANTS = {"token": ("", "vmask", "rowscale", "rowscale+vmask"),
                    "tensor": ("", "vmask"), None: ("",)}


def sweep_prefill_two_phase(b: Bench, shapes, storage, mode, smoke: bool, tiles=None):
    """Tile shapes x warps first (plain upcast; ``tiles``: the candidates, default
    ``prefill_shapes_grid``), then stages x variants around the winner."""
    tiles = tiles or prefill_shapes_grid(smoke)
    best = tiles[0] if len(tiles) == 1 else sweep_prefill(b, shapes, storage, mode, tiles)
    grid2 = [dataclasses.replace(best, num_stages=ns, variant=var)
             for ns in (2, 3) for var in PREFILL_VARIANTS[mode]]
    grid2 = [t for t in grid2 if t != best][:1 if smoke else None]
    return sweep_prefill(b, shapes, storage, mode, [best] + grid2)


# Issue 13 comparison (``--compare``): the store's f32 -> fp8 cast paths, the fused prologue
# store the engine runs (fp8 modes against bf16) and the decode P.V candidates, each next to
# bf16 and today's default, with ratios, in one run.
COMPARE_OPS = {"store": "store", "prologue": "prologue_store", "decode": "decode_attention",
               "splits": "decode_splits", "waves": "decode_waves", "pages": "decode_pages",
               "split_loop": "split_loop", "mosaic": "decode_mosaic",
               "mosaic_t": "decode_mosaic_t", "mosaic_prefill": "prefill_mosaic"}
# "splits": decode_attention with the default tunings' one-wave rule (no split, no combine
# pass) against the same tunings without it, at batches whose batch * kv_heads it changes
# (Qwen3-0.6B at B=32; Qwen3-8B at B=32 and at the 44 sequences an fp8 16 GB pool runs)
COMPARE_SPLIT_SHAPES = ((32, 640, 16, 8, 128), (32, 4096, 32, 8, 128), (44, 4608, 32, 8, 128))
# "waves": the kernel table's decode shapes at explicit split counts around today's choice
# (powers of two up to 528 programs), bf16 and fp8 token: whether programs that fill whole
# waves of resident CTAs (3 per SM at the defaults' shared memory) beat the rule
COMPARE_WAVE_SPLITS = {(64, 8192, 32, 8, 128): (1, 2, 3, 4, 5, 6),
                       (64, 8192, 9, 3, 64): (2, 3, 4, 5, 6, 8),
                       (8, 32768, 32, 8, 128): (4, 6, 8, 12, 16, 24)}
COMPARE_STORE_CASTS = ("software", "hardware", "satfinite")
COMPARE_DECODE_VARIANTS = (  # (variant, block_k, num_stages); the first is today's default
    ("pagepf+asm", 128, 3), ("pagepf+asm+vmask", 128, 3), ("pagepf+asm+vmask", 128, 2),
    ("pagepf+asm+vmask", 64, 3), ("pagepf+asm+nomma", 32, 3))


def add_bf16_ratios(rows):
    """rows[0] is bf16: the others get ``ratio_vs_bf16`` (time / its time)."""
    if not rows or "ms" not in rows[0]:
        return
    for r in rows[1:]:
        if "ms" in r:
            r["ratio_vs_bf16"] = round(r["ms"] / rows[0]["ms"], 3)


def compare(b: Bench, sections, smoke: bool, budget_s: float):
    """Rows under doc["compare"] with ``ratio_vs_bf16`` (time / bf16 time, same shape) and,
    for decode, ``ratio_vs_default`` (time / today's default variant). Stops starting new
    rows after ``budget_s`` seconds (the skipped rows are listed in doc["compare_skipped"])."""
    t0 = time.perf_counter()
    b.doc.setdefault("compare", [])
    b.doc["compare_skipped"] = []

    def run(label, fn):
        if time.perf_counter() - t0 > budget_s:
            b.doc["compare_skipped"].append(label)
            return None
        return fn()

    # stores: per size, bf16 and every fp8 row timed side by side (``store_group``)
    sizes = (512, 2048, 8192) if not smoke else (40,)
    if "store" in sections:
        casts = COMPARE_STORE_CASTS[:2] if smoke else COMPARE_STORE_CASTS
        for tokens in sizes:
            specs = [dict(storage="bfloat16", mode=None, tokens=tokens)] + [
                dict(storage="float8_e4m3fn", mode=m, tokens=tokens, fp8_cast=c)
                for m in ("token", "tensor", "block") for c in casts]
            rows = run(f"store {tokens}", lambda: b.store_group(specs, "compare"))
            add_bf16_ratios(rows)
            b.save()
    if "prologue" in sections:  # the store the engine runs: q/k norm + RoPE + store, 32/8/128
        heads = dict(hq=4, hkv=2, d=64) if smoke else dict(hq=32, hkv=8, d=128)
        for tokens in sizes:
            specs = [dict(storage="bfloat16", mode=None, tokens=tokens, **heads)] + [
                dict(storage="float8_e4m3fn", mode=m, tokens=tokens, **heads)
                for m in ("token", "tensor", "block", "channel")]
            rows = run(f"prologue store {tokens}", lambda: b.store_group(specs, "compare"))
            add_bf16_ratios(rows)
            b.save()
    if "decode" in sections:
        D = pallas_decode.DecodeTuning
        shapes = [(64, 8192, 32, 8, 128), (64, 8192, 9, 3, 64), (8, 32768, 32, 8, 128)]
        if smoke:
            shapes = [(2, 64, 8, 2, 64)]
        for batch, ctx, hq, hkv, d in shapes:
            bf = pallas_decode.default_tuning(cache_cfg("bfloat16", None, hkv, d, 2))
            base = run(f"decode bf16 {batch}x{ctx} {hq}/{hkv}/{d}", lambda: b.decode(
                "jfp8kv", "bfloat16", None, batch, ctx, hq, hkv, d, bf, where="compare"))
            for mode in ("token", "tensor"):
                default = None
                for i, (var, bk, ns) in enumerate(COMPARE_DECODE_VARIANTS):
                    t = D(block_k=bk, num_stages=ns, target_programs=528, variant=var)
                    r = run(f"decode {mode} {var} bk{bk} ns{ns} {batch}x{ctx} {hq}/{hkv}/{d}",
                            lambda: b.decode("jfp8kv", "float8_e4m3fn", mode, batch, ctx, hq,
                                             hkv, d, t, where="compare"))
                    if not r or "ms" not in r:
                        continue
                    if base and "ms" in base:
                        r["ratio_vs_bf16"] = round(r["ms"] / base["ms"], 3)
                    if i == 0:
                        default = r
                    elif default:
                        r["ratio_vs_default"] = round(r["ms"] / default["ms"], 3)
                    b.save()
    if "splits" in sections:
        compare_splits(b, smoke, run)
    if "waves" in sections:
        compare_waves(b, smoke, run)
    if "pages" in sections:
        compare_pages(b, smoke, run)
    if "split_loop" in sections:
        compare_split_loop(b, smoke, run)
    if "mosaic_prefill" in sections:  # before "mosaic": the budget cuts the later rows
        compare_mosaic_prefill(b, smoke, run)
    if "mosaic" in sections:
        compare_mosaic(b, smoke, run)
    elif "mosaic_t" in sections:  # the transposed kernel's rows beside Triton's only
        compare_mosaic(b, smoke, run, old=False)
    b.doc.setdefault("compare_elapsed_s", {})[",".join(sorted(sections))] = round(
        time.perf_counter() - t0, 1)
    b.save()


def decode_series(b: Bench, run, op: str, shapes, settings):
    """Decode rows (op ``op``) of the default tuning per storage (bf16, fp8 token) at each
    shape (batch, context, hq, hkv, d), changed by each of ``settings(shape)``: (label,
    tuning -> tuning, page size). Every row records its split count and programs; all but
    the first of a series get ``ratio_vs_first`` (time / the first setting's)."""
    for shape in shapes:
        batch, ctx, hq, hkv, d = shape
        for storage, mode in (("bfloat16", None), ("float8_e4m3fn", "token")):
            base = pallas_decode.default_tuning(cache_cfg(storage, mode, hkv, d, 2))
            first = None
            for label, change, page_size in settings(shape):
                t = change(base)
                r = run(f"{op} {storage} {label} {batch}x{ctx} {hq}/{hkv}/{d}", lambda: b.decode(
                    "jfp8kv", storage, mode, batch, ctx, hq, hkv, d, t, where="compare",
                    page_size=page_size))
                if not r or "ms" not in r:
                    continue
                ns = pallas_decode.choose_splits(batch, hkv, ctx, t)
                r.update(op=op, setting=label, num_splits=ns, programs=batch * hkv * ns,
                         page_size=page_size)
                if first is None:
                    first = r
                else:
                    r["ratio_vs_first"] = round(r["ms"] / first["ms"], 3)
                b.save()


def compare_splits(b: Bench, smoke: bool, run):
    """"splits": the defaults' one-wave rule, then the same tunings without it."""
    widen = (lambda t: dataclasses.replace(t, unsplit_programs=(1, 4))) if smoke else (
        lambda t: t)  # smoke: 2 x 2 pairs, a window the rule takes
    decode_series(b, run, "decode_splits",
                  COMPARE_SPLIT_SHAPES if not smoke else ((2, 64, 8, 2, 64),),
                  lambda shape: [("one-wave rule", widen, 16), ("split rule", lambda t:
                                 dataclasses.replace(t, unsplit_programs=(0, 0)), 16)])


def compare_waves(b: Bench, smoke: bool, run):
    """"waves": today's rule (``num_splits`` 0), then each split count of
    ``COMPARE_WAVE_SPLITS``."""
    table = COMPARE_WAVE_SPLITS if not smoke else {(2, 64, 8, 2, 64): (1, 3)}
    decode_series(b, run, "decode_waves", list(table), lambda shape: [
        (f"ns{ns}", lambda t, ns=ns: dataclasses.replace(t, num_splits=ns), 16)
        for ns in (0, *table[shape])])


def compare_pages(b: Bench, smoke: bool, run):
    """"pages": page sizes 16, 32 and 64, B=64 context 8k and B=8 context 32k (32/8/128).
    The question: a 16-token fp8 page of one KV head is 2 KB of contiguous bytes (bf16:
    4 KB), and the tiles gather pages scattered over the pool; do larger fp8 pages read
    faster?"""
    shapes = ((64, 8192, 32, 8, 128), (8, 32768, 32, 8, 128)) if not smoke else (
        (2, 64, 8, 2, 64),)
    decode_series(b, run, "decode_pages", shapes,
                  lambda shape: [(f"S{s}", lambda t: t, s) for s in (16, 32, 64)])


# "split_loop": each attention kernel's default tuning with ``Variant.split_loop`` off
# ("masked": every tile masked) and on ("split": tiles every query row sees in full run
# first, in a loop without masks), side by side: decode at the kernel table's shapes and
# Qwen3-0.6B's short engine context, prefill at 2,048 after 2,048 and 8,192 x 8,192 causal
# (32/8/128), bf16 and every fp8 scale mode.
SPLIT_DECODE_SHAPES = ((32, 640, 16, 8, 128), (64, 8192, 32, 8, 128), (8, 32768, 32, 8, 128),
                       (64, 8192, 9, 3, 64))
SPLIT_PREFILL_SHAPES = ((1, 2048, 2048), (1, 8192, 0))  # (batch, chunk, prefix)
SPLIT_PREFILL_KV = (("bfloat16", None), ("float8_e4m3fn", "token"), ("float8_e4m3fn", "tensor"),
                    ("float8_e4m3fn", "block"), ("float8_e4m3fn", "channel"))


def with_split_loop(on: bool):
    return lambda t: dataclasses.replace(t, variant=dataclasses.replace(t.variant,
                                                                        split_loop=on))


SPLIT_SETTINGS = (("masked", with_split_loop(False)), ("split", with_split_loop(True)))


def compare_split_loop(b: Bench, smoke: bool, run):
    """"split_loop": rows (``kernel`` decode / prefill) with ``setting`` "masked" / "split"
    and ``ratio_vs_first``; prefill rows also ``ratio_vs_bf16`` (bf16 in the same setting)."""
    decode_series(b, run, "split_loop", SPLIT_DECODE_SHAPES if not smoke else
                  ((2, 64, 8, 2, 64),),
                  lambda shape: [(label, change, 16) for label, change in SPLIT_SETTINGS])
    for r in b.doc["compare"]:
        if r.get("op") == "split_loop":
            r.setdefault("kernel", "decode")
    shapes = SPLIT_PREFILL_SHAPES if not smoke else ((1, 32, 16),)
    heads = dict(hq=32, hkv=8, d=128) if not smoke else dict(hq=8, hkv=2, d=64)
    kvs = SPLIT_PREFILL_KV if not smoke else SPLIT_PREFILL_KV[:2]
    for batch, chunk, prefix in shapes:
        bf16 = {}
        for storage, mode in kvs:
            cfg = cache_cfg(storage, mode, heads["hkv"], heads["d"], 2)
            first = None
            for label, change in SPLIT_SETTINGS:
                t = change(pallas_prefill.default_tuning(cfg))
                r = run(f"prefill {storage} {mode} {label} {chunk}+{prefix}",
                        lambda: b.prefill(storage, mode, batch, chunk, prefix, tuning=t,
                                          where="compare", **heads))
                if not r or "ms" not in r:
                    continue
                r.update(op="split_loop", kernel="prefill", setting=label)
                if first is None:
                    first = r
                else:
                    r["ratio_vs_first"] = round(r["ms"] / first["ms"], 3)
                if storage == "bfloat16":
                    bf16[label] = r
                elif label in bf16:
                    r["ratio_vs_bf16"] = round(r["ms"] / bf16[label]["ms"], 3)
                b.save()


# "mosaic": the Mosaic GPU decode kernel (``lab.mosaic_decode``: warp-specialized, TMA
# page copies, fp8 upcast once into shared memory, wgmma) next to the Triton kernel's default
# for fp8 and bf16 pages, at the split-loop comparison's decode shapes, e4m3 token and tensor,
# and at other stage and compute-warpgroup counts (token).
MOSAIC_SETTINGS = (("st4", {}), ("st2", dict(stages=2)), ("st4 overlap_v", dict(overlap_v=True)))
# diagnostics (wrong results, timing only): the kernel with a part of its work skipped, at
# the first shape with token scales
MOSAIC_PROBES = ("compute", "convert", "mma")
# the transposed kernel (``lab.mosaic_decode_t``: S^T = K q^T, O^T = V^T P^T, the G
# query heads padded to 8 or 16 instead of 64): the fp8 upcast in a dedicated warpgroup
# ("w") or in the compute warpgroups ("c"), 1 or 2 compute warpgroups, fp8 ring stages;
# "narrow": the upcast in the layout Mosaic infers instead of 8 values a thread; "kregs": K
# upcast into registers as S^T's A operand (no f16 K tile in shared memory). Rows also
# under ``--compare mosaic_t`` (Triton's rows and these only: one short device call).
MOSAIC_T_SETTINGS = (  # fewest warpgroups first (setmaxnreg: a wrong budget hangs)
    ("t c1 st4", dict(upcast="compute", compute_wgs=1, stages=4)),
    ("t w1 st4", dict(upcast="warpgroup", compute_wgs=1, stages=4, f16_stages=2)),
    ("t c2 st4", dict(upcast="compute", compute_wgs=2, stages=4)),
    ("t w2 st4", dict(upcast="warpgroup", compute_wgs=2, stages=4, f16_stages=2)),
    ("t c2 st8", dict(upcast="compute", compute_wgs=2, stages=8)),
    ("t w2 st6", dict(upcast="warpgroup", compute_wgs=2, stages=6, f16_stages=2)),
    ("t w2 st4 narrow", dict(upcast="warpgroup", compute_wgs=2, stages=4, f16_stages=2,
                             wide_upcast=False)),
    ("t c1 st4 kregs", dict(upcast="compute", compute_wgs=1, stages=4, k_regs=True)),
    ("t c2 st4 kregs", dict(upcast="compute", compute_wgs=2, stages=4, k_regs=True)),
)
MOSAIC_T_TENSOR = ("t c2 st4", "t w2 st4")  # the settings also timed with tensor scales
# its diagnostics (wrong results, timing only; ``mosaic_decode_t.PROBES``) at the second
# shape, token scales: (setting, probe)
MOSAIC_T_PROBES = (("t c1 st4", "copies"), ("t c1 st4", "no_upcast"), ("t w1 st4", "copies"),
                   ("t w1 st4", "no_mma"))


def compare_mosaic(b: Bench, smoke: bool, run, old: bool = True):
    """Rows ``op`` "decode_mosaic", ``setting`` (triton | mosaic stN | mosaic t ...),
    ``ratio_vs_bf16`` (the Triton bf16 row of the shape) and, for mosaic rows,
    ``ratio_vs_triton`` (the Triton fp8 row of the same mode). ``old=False``
    (``--compare mosaic_t``): without the padded kernel's (``mosaic_decode``) rows, every
    row under ``op`` "decode_mosaic_t" (a re-run keeps the "decode_mosaic" rows). A row whose
    kernel raises records its error (``Bench.decode``); the others still run."""
    from lab.mosaic_decode import MosaicDecodeTuning
    from lab.mosaic_decode_t import MosaicDecodeTTuning

    shapes = SPLIT_DECODE_SHAPES if not smoke else ((2, 64, 8, 2, 64),)

    def row(label, impl, storage, mode, shape, tuning, page_size=16):
        batch, ctx, hq, hkv, d = shape
        r = run(f"mosaic {label} {storage} {mode} {batch}x{ctx} {hq}/{hkv}/{d}", lambda: b.decode(
            impl, storage, mode, batch, ctx, hq, hkv, d, tuning, where="compare",
            page_size=page_size))
        if r:
            r.update(op="decode_mosaic" if old else "decode_mosaic_t", setting=label)
        return r if r and "ms" in r else None

    for shape in shapes:
        bf = row("triton", "jfp8kv", "bfloat16", None, shape, None)
        for mode in ("token", "tensor"):
            tri = row("triton", "jfp8kv", "float8_e4m3fn", mode, shape, None)
            # --smoke: no mosaic rows (a chain of interpreted Mosaic kernels takes minutes;
            # tests/kernels/test_mosaic_decode.py runs the kernel in interpret mode)
            settings = () if smoke or not old else (
                MOSAIC_SETTINGS if mode == "token" else MOSAIC_SETTINGS[:1])
            settings_t = () if smoke else tuple(
                (label, knobs) for label, knobs in MOSAIC_T_SETTINGS
                if mode == "token" or label in MOSAIC_T_TENSOR)
            for impl, label, tuning in (
                    [("mosaic", label, MosaicDecodeTuning(**knobs)) for label, knobs in settings]
                    + [("mosaic_t", label, MosaicDecodeTTuning(**knobs))
                       for label, knobs in settings_t]):
                r = row(f"mosaic {label}", impl, "float8_e4m3fn", mode, shape, tuning)
                for ref, key in ((bf, "ratio_vs_bf16"), (tri, "ratio_vs_triton")):
                    if r and ref:
                        r[key] = round(r["ms"] / ref["ms"], 3)
            if tri and bf:
                tri["ratio_vs_bf16"] = round(tri["ms"] / bf["ms"], 3)
        b.save()
    knobs_t = dict(MOSAIC_T_SETTINGS)
    for label, probe in () if smoke else MOSAIC_T_PROBES:
        row(f"{label} probe {probe}", "mosaic_t", "float8_e4m3fn", "token", shapes[1],
            MosaicDecodeTTuning(**knobs_t[label], probe=probe))
    for probe in () if smoke or not old else MOSAIC_PROBES:
        row(f"probe {probe}", "mosaic", "float8_e4m3fn", "token", shapes[1],
            MosaicDecodeTuning(probe=probe))
    if not smoke and old:  # 64-token pages: one copy per tile and operand instead of four
        for impl, label in (("jfp8kv", "triton S64"), ("mosaic", "mosaic st4 S64"),
                            ("mosaic", "probe compute S64")):
            row(label, impl, "float8_e4m3fn", "token", shapes[1],
                MosaicDecodeTuning(probe="compute" if "probe" in label else "")
                if impl == "mosaic" else None, page_size=64)
    b.save()


# "mosaic_prefill": the Mosaic GPU prefill kernel (``kernels.mosaic_prefill``: FA3's structure,
# TMA page copies, wgmma) next to the Triton kernel's default, bf16 and e4m3 token / tensor,
# at the prefill sweep's shapes (batch, chunk, cached prefix): 8k x 8k causal and 2k after 4k.
MOSAIC_PREFILL_SHAPES = ((1, 8192, 0), (1, 2048, 4096))
# the online softmax's rescale placement (``MosaicPrefillTuning.early_rescale``), timed
# beside the default for every storage (one of the two is the default again: early for
# 16-bit pages and token scales, late for static fp8 scales)
MOSAIC_PREFILL_SOFTMAX = (("st3 fma, late rescale", dict(early_rescale=False)),
                          ("st3 fma, early rescale", dict(early_rescale=True)))
MOSAIC_PREFILL_SETTINGS = (("st3", {}), *MOSAIC_PREFILL_SOFTMAX,
                           ("st4", dict(stages=4)), ("st3 no pingpong", dict(pingpong=False)),
                           ("bk128 st2", dict(block_k=128, stages=2)))  # 16-bit pages only
# fp8 pages: K and V upcast by two warpgroups at once (``MosaicPrefillTuning.upcast_wgs``)
MOSAIC_PREFILL_FP8 = (("st3 2 upcast wgs", dict(upcast_wgs=2)),)
# token scales gathered per batch row in XLA, two copies a tile (``gather_scales``)
MOSAIC_PREFILL_GATHER = (("st3 gathered scales", dict(gather_scales=True)),
                         ("st3 2 upcast wgs, gathered scales",
                          dict(upcast_wgs=2, gather_scales=True)))
# e4m3 pages: q.K^T as an e4m3 wgmma (``MosaicPrefillTuning.compute``, issue 34)
MOSAIC_PREFILL_PRODUCTS = (("st3 fp8 products", dict(compute="fp8")),)


def compare_mosaic_prefill(b: Bench, smoke: bool, run):
    """Rows ``op`` "prefill_mosaic", ``setting`` (triton | mosaic stN), ``ratio_vs_bf16`` (the
    Triton bf16 row of the shape) and, for mosaic rows, ``ratio_vs_triton`` (the Triton row
    of the same storage and mode)."""
    from jfp8kv.kernels.mosaic_prefill import MosaicPrefillTuning

    shapes = MOSAIC_PREFILL_SHAPES if not smoke else ((1, 32, 16),)

    def row(label, impl, storage, mode, shape, tuning):
        batch, chunk, prefix = shape
        r = run(f"mosaic prefill {label} {storage} {mode} {batch}x{chunk}+{prefix}",
                lambda: b.prefill(storage, mode, batch, chunk, prefix, tuning=tuning,
                                  where="compare", impl=impl))
        if r:
            r.update(op="prefill_mosaic", setting=label)
        return r if r and "ms" in r else None

    for shape in shapes:
        bf = None
        for storage, mode in (("bfloat16", None), ("float8_e4m3fn", "token"),
                              ("float8_e4m3fn", "tensor")):
            tri = row("triton", "jfp8kv", storage, mode, shape, None)
            bf = tri if storage == "bfloat16" else bf
            # --smoke: no mosaic rows (tests/kernels/test_mosaic_prefill.py interprets it)
            settings = () if smoke else (
                MOSAIC_PREFILL_SETTINGS if storage == "bfloat16" else
                MOSAIC_PREFILL_SETTINGS[:1] + MOSAIC_PREFILL_FP8
                + (MOSAIC_PREFILL_GATHER if mode == "token" else ())
                + MOSAIC_PREFILL_SETTINGS[1:3] + MOSAIC_PREFILL_PRODUCTS)
            for label, knobs in settings:
                r = row(f"mosaic {label}", "mosaic", storage, mode, shape,
                        MosaicPrefillTuning(**knobs))
                for ref, key in ((bf, "ratio_vs_bf16"), (tri, "ratio_vs_triton")):
                    if r and ref:
                        r[key] = round(r["ms"] / ref["ms"], 3)
            if tri and bf and tri is not bf:
                tri["ratio_vs_bf16"] = round(tri["ms"] / bf["ms"], 3)
        b.save()


# Issue 14 (``--kv-rotation``): the K transform's cost (``kvcache.k_transform``: K rotated
# and/or smoothed before the store kernel, in ``jfp8kv.kernels.store_kv``; queries rotated
# inside the Pallas attention kernels), so these rows time the dispatchers ``store_kv`` /
# ``paged_attention`` (default tunings, as the engine runs them), for kv_rotation
# "none" and each transform, side by side on the same data, in one run.
ROTATION_OPS = ("decode", "prefill", "store")
ROTATION_MODES = ("token", "block", "tensor")
ROTATION_TARGET_PCT = 3.0  # issue 14: the rotation costs < 3% of decode and prefill attention


def rotation_shapes(op: str, smoke: bool):
    """Per op: decode (batch, context, hq, hkv, d); prefill (batch, chunk, prefix, hq, hkv,
    d); store (tokens, hkv, d). Head dims 128 (Llama-like) and 64 (SmolLM2 9/3, Qwen2.5-0.5B
    14/2). The stores are the ones each attention shape's step makes (a prefill step stores
    its batch x chunk new rows, a decode step its batch rows), so ``rotation_phase_summary``
    can add the store's cost to the attention's."""
    if smoke:
        shapes = {"decode": [(2, 64, 8, 2, 64)], "prefill": [(1, 32, 16, 8, 2, 64)]}
    else:
        shapes = {"decode": [(64, 8192, 32, 8, 128), (64, 8192, 14, 2, 64)],
                  "prefill": [(1, 2048, 2048, 32, 8, 128), (1, 4096, 4096, 14, 2, 64)]}
    if op != "store":
        return shapes[op]
    stores = [(b * c, hkv, d) for b, c, _, _, hkv, d in shapes["prefill"]]
    stores += [(b, hkv, d) for b, _, _, hkv, d in shapes["decode"]]
    return list(dict.fromkeys(stores))


def dispatch_chain(op: str, cfg: CacheConfig, backend: str):
    """reps -> jitted chain of ``reps`` dependent calls of the dispatcher-level op: decode
    f(q [B, 1, H, D], layer, pt, lens), prefill f(q [B, T, H, D], layer, pt, lens, pos),
    store f(layer, k, v, slots, shift) (the shift re-attached before every store, as the
    engine's cache does)."""
    from jfp8kv import kernels

    sm = 1.0 / float(np.sqrt(cfg.head_dim))

    def make(reps):
        if op == "store":
            @functools.partial(jax.jit, donate_argnums=(0,))
            def f(layer, k, v, slots, shift):
                tot = jnp.zeros((6,), jnp.float32)
                for _ in range(reps):
                    layer = LayerKV(layer.k, layer.v, layer.k_scale, layer.v_scale, shift)
                    layer, st = kernels.store_kv(layer, k, v, slots, cfg, backend)
                    tot = tot + st
                return layer, tot
            return f

        return chain(lambda q, layer, pt, lens, pos: kernels.paged_attention(
            q, layer, pt, lens, pos, cfg, sm, backend))(reps)
    return make


def rotation_op_name(op: str) -> str:
    """--rotation-ops name -> the records' ``op``."""
    return {"decode": "decode_attention", "prefill": "prefill_attention"}.get(op, op)


def rotation_row(b: "Bench", op: str, mode: str, shape, rot: str, seed: int):
    """Time one dispatcher-level op for one kv_rotation; the data depend only on ``seed``
    (the same for every rotation of a group). -> the record (with ``error`` on failure)."""
    rec = dict(op=rotation_op_name(op),
               impl="jfp8kv.kernels", kv_cache_dtype="fp8_e4m3", kv_scale_mode=mode,
               kv_rotation=rot)
    backend = "pallas_interpret" if b.interpret else "pallas"
    rng, s = np.random.default_rng(seed), 16
    try:
        if op == "store":
            tokens, hkv, d = shape
            rec.update(batch=1, tokens=tokens, num_kv_heads=hkv, head_dim=d)
            p = 2 + 2 * tokens // s
            cfg = dataclasses.replace(cache_cfg("float8_e4m3fn", mode, hkv, d, p, s),
                                      kv_rotation=rot)
            layer, _, _ = make_layer(rng, cfg, 1, s)
            kk, kv, ksh = jax.random.split(jax.random.key(seed), 3)
            k = jax.random.normal(kk, (tokens, hkv, d), jnp.bfloat16)
            v = jax.random.normal(kv, (tokens, hkv, d), jnp.bfloat16)
            shift = 0.5 * jax.random.normal(ksh, (hkv, d), jnp.float32)
            slots = jnp.asarray(rng.permutation((p - 1) * s)[:tokens] + s, jnp.int32)
            make, holder = dispatch_chain("store", cfg, backend), {"layer": layer}

            def fn(reps):  # donation consumes the layer: thread it through the calls
                f = make(reps)

                def g(k, v, slots, shift):
                    holder["layer"], tot = f(holder["layer"], k, v, slots, shift)
                    return tot
                return g
            ms, reps = timed(fn, k, v, slots, shift, est_ms=0.004 + tokens * hkv * d * 8 / 1e9,
                             calls=2 if b.smoke else 10, max_reps=2 if b.smoke else 48)
        else:
            if op == "decode":
                batch, ctx, hq, hkv, d = shape
                chunk, prefix = 1, ctx - 1
                rec.update(batch=batch, context=ctx)
            else:
                batch, chunk, prefix, hq, hkv, d = shape
                ctx = prefix + chunk
                rec.update(batch=batch, tokens=chunk, context=ctx)
            rec.update(num_heads=hq, num_kv_heads=hkv, head_dim=d)
            cfg = dataclasses.replace(
                cache_cfg("float8_e4m3fn", mode, hkv, d, 1 + batch * (-(-ctx // s)), s),
                kv_rotation=rot)
            layer, pt, lens = make_layer(rng, cfg, batch, ctx)
            q = jax.random.normal(jax.random.key(seed), (batch, chunk, hq, d), jnp.bfloat16)
            pos = jnp.broadcast_to(jnp.arange(prefix, ctx, dtype=jnp.int32), (batch, chunk))
            est = (kv_bytes(cfg, batch * ctx) / 2e9 if op == "decode"
                   else 4 * batch * hq * d * chunk * (prefix + chunk / 2) / 2e11)
            ms, reps = timed(dispatch_chain(op, cfg, backend), q, layer, pt, lens, pos,
                             est_ms=est, calls=2 if b.smoke else 8,
                             max_reps=2 if b.smoke else 48)
        rec.update(ms=round(ms, 5), reps=reps)
    except Exception as e:  # noqa: BLE001 - a failed row is recorded, not fatal
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return rec


def rotation_compare(b: "Bench", rotations, ops, smoke: bool, budget_s: float):
    """Rows under doc["rotation"]: per (op, scale mode, shape), kv_rotation "none", each of
    ``rotations``, then "none" again, on the same data. Each transform's row gets
    ``ratio_vs_none`` (its time / the mean of the two "none" times) and ``cost_pct``; the
    second "none" row's ``ratio_vs_none`` (vs the first) shows the timing noise.
    doc["rotation_summary"]: per op and transform, the worst and median cost against the
    op's own time. doc["rotation_phase"] / ["rotation_phase_summary"]: the issue's verdict,
    per phase (store of the step's rows + attention, against attention; see
    ``rotation_phase_rows``)."""
    t0 = time.perf_counter()
    b.doc.setdefault("rotation", [])
    b.doc["rotation_skipped"] = []
    seed = 100
    for op in ops:
        for shape in rotation_shapes(op, smoke):
            for mode in ROTATION_MODES:
                seed += 1
                label = f"{op} {mode} {shape}"
                if time.perf_counter() - t0 > budget_s:
                    b.doc["rotation_skipped"].append(label)
                    continue
                rows = [rotation_row(b, op, mode, shape, r, seed)
                        for r in ("none", *rotations, "none")]
                nones = [r["ms"] for r in (rows[0], rows[-1]) if "ms" in r]
                if nones:
                    ref = float(np.mean(nones))
                    if len(nones) == 2:
                        rows[-1]["ratio_vs_none"] = round(nones[1] / nones[0], 4)
                        rows[-1]["repeat"] = True
                    for r in rows[1:-1]:
                        if "ms" in r:
                            r["ratio_vs_none"] = round(r["ms"] / ref, 4)
                            r["cost_pct"] = round(100 * (r["ms"] / ref - 1), 2)
                for r in rows:
                    b.add(r, "rotation")
    b.doc["rotation_summary"] = rotation_summary(b.doc["rotation"])
    b.doc["rotation_phase"] = rotation_phase_rows(b.doc["rotation"])
    b.doc["rotation_phase_summary"] = rotation_phase_summary(b.doc["rotation_phase"])
    b.doc["rotation_elapsed_s"] = round(time.perf_counter() - t0, 1)
    b.save()


def rotation_summary(rows) -> list:
    """Per (op, kv_rotation): rows measured, worst and median ``cost_pct``, the op's largest
    none-vs-none repeat difference (timing noise), whether the worst cost is under
    ROTATION_TARGET_PCT, and whether the noise is small enough for that verdict to mean
    anything (``resolved``: noise below the target)."""
    out = []
    for op in dict.fromkeys(r["op"] for r in rows):
        noise = [100 * abs(r["ratio_vs_none"] - 1) for r in rows
                 if r["op"] == op and r.get("repeat")]
        for rot in dict.fromkeys(r["kv_rotation"] for r in rows if r["kv_rotation"] != "none"):
            cost = [r["cost_pct"] for r in rows if r["op"] == op and r["kv_rotation"] == rot
                    and "cost_pct" in r]
            if not cost:
                continue
            out.append({"op": op, "kv_rotation": rot, "rows": len(cost),
                        "max_cost_pct": max(cost), "median_cost_pct": float(np.median(cost)),
                        "noise_pct_max": round(max(noise), 2) if noise else None,
                        "under_target": bool(max(cost) < ROTATION_TARGET_PCT),
                        "resolved": bool(noise) and max(noise) < ROTATION_TARGET_PCT,
                        "target": f"< {ROTATION_TARGET_PCT}% of the op's time"})
    return out


# The target is per phase: what the transform adds to a prefill (or decode) step --
# the store of the step's new K rows plus the queries' rotation inside attention -- as a
# fraction of that step's attention time with kv_rotation "none".
ROTATION_PHASES = {"prefill": "prefill_attention", "decode": "decode_attention"}


def _times_ms(rows, op, rot, key):
    """The timed ms of one (op, kv_rotation, group) in ``rows``."""
    return [r["ms"] for r in rows if r["op"] == op and r["kv_rotation"] == rot and "ms" in r
            and _group_key(r) == key]


def _median_ms(rows, op, rot, key):
    ms = _times_ms(rows, op, rot, key)
    return float(np.median(ms)) if ms else None


def _group_key(r):
    return tuple(r.get(k) for k in ("kv_scale_mode", "batch", "tokens", "context", "num_heads",
                                    "num_kv_heads", "head_dim"))


def _spread_ms(rows, op, key):
    """max - min of the "none" rows of one group (its two repeats): the timing noise."""
    ms = _times_ms(rows, op, "none", key)
    return max(ms) - min(ms) if len(ms) > 1 else None


def rotation_phase_rows(rows) -> list:
    """One entry per (phase, attention group, transform): the attention's extra ms over
    "none", the extra ms of the matched store (same scale mode, head shape, and the step's
    new rows: batch x tokens for prefill, batch for decode; None when not measured), and
    ``cost_pct`` = 100 (attention extra + store extra) / attention "none" ms. Medians of the
    matched rows; ``noise_pct``: the two groups' none-vs-none spreads, in the same units."""
    out = []
    for phase, op in ROTATION_PHASES.items():
        keys = dict.fromkeys(_group_key(r) for r in rows if r["op"] == op)
        rots = dict.fromkeys(r["kv_rotation"] for r in rows
                             if r["op"] == op and r["kv_rotation"] != "none")
        for key in keys:
            mode, batch, tokens, _, _, hkv, d = key
            new_rows = batch * (tokens if phase == "prefill" else 1)
            skey = (mode, 1, new_rows, None, None, hkv, d)
            base, sbase = _median_ms(rows, op, "none", key), _median_ms(rows, "store", "none",
                                                                           skey)
            spread = [x for x in (_spread_ms(rows, op, key), _spread_ms(rows, "store", skey))
                      if x is not None]
            for rot in rots:
                ms, sms = _median_ms(rows, op, rot, key), _median_ms(rows, "store", rot, skey)
                if base is None or ms is None:
                    continue
                store = None if sbase is None or sms is None else sms - sbase
                out.append({"phase": phase, "kv_rotation": rot, "kv_scale_mode": mode,
                            "batch": batch, "tokens": tokens, "context": key[3],
                            "num_heads": key[4], "num_kv_heads": hkv, "head_dim": d,
                            "attention_none_ms": round(base, 5),
                            "attention_extra_ms": round(ms - base, 5),
                            "store_rows": new_rows,
                            "store_extra_ms": None if store is None else round(store, 5),
                            "cost_pct": round(100 * (ms - base + (store or 0.0)) / base, 2),
                            "noise_pct": round(100 * sum(spread) / base, 2) if spread else None})
    return out


def rotation_phase_summary(phase_rows) -> list:
    """Per (phase, kv_rotation): worst and median ``cost_pct`` of ``rotation_phase_rows``,
    the worst noise, ``under_target`` (worst cost < ROTATION_TARGET_PCT), ``resolved`` (noise
    below the target) and ``store_included`` (every group had its matched store measured;
    otherwise the cost is the attention's alone)."""
    out = []
    for phase in ROTATION_PHASES:
        for rot in dict.fromkeys(r["kv_rotation"] for r in phase_rows if r["phase"] == phase):
            sel = [r for r in phase_rows if r["phase"] == phase and r["kv_rotation"] == rot]
            cost = [r["cost_pct"] for r in sel]
            noise = [r["noise_pct"] for r in sel if r["noise_pct"] is not None]
            out.append({"phase": phase, "kv_rotation": rot, "groups": len(sel),
                        "max_cost_pct": max(cost), "median_cost_pct": float(np.median(cost)),
                        "noise_pct_max": max(noise) if noise else None,
                        "under_target": bool(max(cost) < ROTATION_TARGET_PCT),
                        "resolved": bool(noise) and max(noise) < ROTATION_TARGET_PCT,
                        "store_included": all(r["store_extra_ms"] is not None for r in sel),
                        "target": f"(store of the step's new rows + attention) extra < "
                                  f"{ROTATION_TARGET_PCT}% of the {phase} attention time"})
    return out


def plot(doc, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in doc["records"] if r["op"] == "decode_attention" and "ms" in r]
    shapes = sorted({(r["num_heads"], r["num_kv_heads"], r["head_dim"], r["batch"], r["context"])
                     for r in recs}, key=lambda x: (x[0], x[3] * x[4]))
    series = sorted({(r["impl"], r["kv_cache_dtype"], r["kv_scale_mode"]) for r in recs},
                    key=str)
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / max(1, len(series))
    for i, ser in enumerate(series):
        ys = []
        for sh in shapes:
            r = [x for x in recs if (x["impl"], x["kv_cache_dtype"], x["kv_scale_mode"]) == ser
                 and (x["num_heads"], x["num_kv_heads"], x["head_dim"], x["batch"],
                      x["context"]) == sh]
            ys.append(r[0]["tbps"] if r else 0)
        ax.bar(np.arange(len(shapes)) + i * width, ys, width,
               label=f"{ser[0]} {ser[1]}" + (f" ({ser[2]})" if ser[2] else ""))
    if doc.get("copy_tbps"):
        ax.axhline(doc["copy_tbps"], color="k", ls="--", lw=1,
                   label=f"device copy {doc['copy_tbps']:.2f} TB/s")
    ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{h}/{hk}/{d}\nB={b} ctx={c}" for h, hk, d, b, c in shapes], fontsize=8)
    ax.set_ylabel("effective TB/s (K+V+scales read once)")
    ax.set_title(f"Paged decode attention, {doc['machine']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/kernels-h200.json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-prefill", action="store_true",
                    help="time prefill launch knobs and fp8 upcast variants first; the "
                    "prefill section then uses the best per storage")
    ap.add_argument("--sweep-small-decode", action="store_true",
                    help="only: decode tunings at Qwen3-0.6B's short engine contexts "
                    "(SMALL_DECODE_SHAPES), bf16 and e4m3 token")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: "
                    "decode,jax,store,prefill")
    ap.add_argument("--compare", default="", help=f"comma list of {','.join(COMPARE_OPS)}: "
                    "only the issue-13 comparisons (fp8 store cast paths, the engine's fused "
                    "prologue store, decode variants, the Mosaic GPU decode kernel, ...; bf16 "
                    "and today's default side by side, with ratios), added to --out under "
                    "'compare' (the file's other results are kept)")
    ap.add_argument("--kv-rotation", default="", metavar="LIST",
                    help="comma list of K transforms (hadamard, smooth, smooth+hadamard, or "
                    "all): only the issue-14 rotation cost, each fp8 row (e4m3 token, block, "
                    "tensor) timed at the dispatcher level with kv_rotation none and with each "
                    "transform side by side, with ratios; added to --out under 'rotation' "
                    "(the file's other results are kept)")
    ap.add_argument("--rotation-ops", default=",".join(ROTATION_OPS),
                    help="with --kv-rotation: comma list of decode,prefill,store")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="--compare / --kv-rotation start no new row (group) after this many "
                    "seconds")
    args = ap.parse_args(argv)
    rotations, ops = parse_rotation_args(ap, args.kv_rotation, args.rotation_ops)
    b = Bench(args.out, args.smoke)
    if rotations:
        return run_rotation(b, args, rotations, ops)
    if args.compare:
        return run_compare(b, args)
    if args.sweep_small_decode:
        return run_small_decode_sweep(b, args.smoke)
    skip = set(filter(None, args.skip.split(",")))
    b.doc["copy_tbps"] = round(copy_tbps(args.smoke), 4)
    print("copy TB/s", b.doc["copy_tbps"], flush=True)
    sm = args.smoke
    big = [(32, 4096), (64, 8192), (8, 32768), (1, 131072)] if not sm else [(2, 64)]
    smol = [(64, 8192)] if not sm else [(2, 64)]
    base = pallas_decode.DecodeTuning()
    tuned = {name: pallas_decode.default_tuning(cache_cfg(name, "token", 8, 128, 2))
             for name in ("float8_e4m3fn", "bfloat16")}
    if args.sweep:
        shapes = [(32, 4096), (8, 32768), (1, 131072)] if not sm else [(2, 64)]
        D = pallas_decode.DecodeTuning
        grid = [D(128, 0, 4, 4, 1056, "asm"),  # best of the first GPU sweep (no page prefetch)
                D(128, 0, 4, 3, 1056, "pagepf+asm"), D(128, 0, 4, 3, 528, "pagepf+asm"),
                D(64, 0, 4, 3, 1056, "pagepf+asm"), D(64, 0, 4, 4, 1056, "pagepf+asm"),
                D(64, 0, 4, 3, 1056, "pagepf+vmask"), D(128, 0, 4, 3, 1056, "pagepf+vmask"),
                D(128, 0, 8, 3, 1056, "pagepf+asm"), D(128, 0, 4, 3, 1056, "pagepf")]
        grid = [dataclasses.asdict(t) for t in (grid[:2] if sm else grid)]
        tuned["float8_e4m3fn"] = sweep_decode(b, shapes, "float8_e4m3fn", "token", base, grid)
        grid3 = [D(128, 0, 8, 3, 528, ""), D(128, 0, 8, 3, 528, "pagepf"),
                 D(64, 0, 4, 3, 528, "pagepf"), D(128, 0, 4, 3, 528, "pagepf"),
                 D(64, 0, 4, 4, 528, "pagepf")]
        grid3 = [dataclasses.asdict(t) for t in (grid3[:2] if sm else grid3)]
        tuned["bfloat16"] = sweep_decode(b, shapes[:2], "bfloat16", None, base, grid3)
    b.doc["tuned"] = {k: dataclasses.asdict(v) for k, v in tuned.items()}
    if "decode" not in skip:
        for (batch, ctx), (hq, hkv, d) in [(x, (32, 8, 128)) for x in big] + \
                [(x, (9, 3, 64)) for x in smol]:
            for storage, mode in (("bfloat16", None), ("float8_e4m3fn", "token"),
                                  ("float8_e4m3fn", "tensor")):
                t = tuned["bfloat16" if storage == "bfloat16" else "float8_e4m3fn"]
                b.decode("jfp8kv", storage, mode, batch, ctx, hq, hkv, d, t)
            if "jax" not in skip and hq == 32:
                for storage, mode in (("bfloat16", None), ("float8_e4m3fn", "token")):
                    b.decode("jax_ops_paged_attention", storage, mode, batch, ctx, hq, hkv, d)
        for (batch, ctx) in big[2:3]:
            b.decode("jfp8kv", "float8_e4m3fn", "block", batch, ctx, 32, 8, 128,
                     tuned["float8_e4m3fn"])
            b.decode("jfp8kv", "float8_e5m2", "token", batch, ctx, 32, 8, 128,
                     tuned["float8_e4m3fn"])
    if "store" not in skip:
        for tokens in ((512, 2048, 8192) if not sm else (40,)):
            for storage, mode in (("bfloat16", None), ("float8_e4m3fn", "token"),
                                  ("float8_e4m3fn", "tensor"), ("float8_e4m3fn", "block")):
                b.store(storage, mode, tokens)
    pre_shapes = [(1, 2048, 2048), (1, 8192, 0)] if not sm else [(1, 32, 16)]
    pre_tuned = {m: pallas_prefill.default_tuning(cache_cfg(st, m, 8, 128, 2))
                 for st, m in (("bfloat16", None), ("float8_e4m3fn", "token"),
                               ("float8_e4m3fn", "tensor"))}
    if args.sweep_prefill:
        pre_tuned["token"] = sweep_prefill_two_phase(b, pre_shapes[:1], "float8_e4m3fn",
                                                     "token", sm)
        pre_tuned[None] = sweep_prefill_two_phase(b, pre_shapes[:1], "bfloat16", None, sm)
        # tensor/channel: phase 2 only, around the token winner's tile
        tile = dataclasses.replace(pre_tuned["token"], variant="")
        pre_tuned["tensor"] = sweep_prefill_two_phase(b, pre_shapes[:1], "float8_e4m3fn",
                                                      "tensor", sm, tiles=[tile])
    b.doc["prefill_tuned"] = {str(k): dataclasses.asdict(v) for k, v in pre_tuned.items()}
    if "prefill" not in skip:
        for batch, chunk, prefix in pre_shapes:
            for storage, mode in (("bfloat16", None), ("float8_e4m3fn", "token"),
                                  ("float8_e4m3fn", "tensor")):
                b.prefill(storage, mode, batch, chunk, prefix, tuning=pre_tuned[mode])
    try:
        plot(b.doc, os.path.splitext(args.out)[0] + ".png")
    except Exception as e:  # noqa: BLE001 - the JSON is the result; the plot is a view of it
        print("plot failed:", e)
    print(json.dumps({"copy_tbps": b.doc["copy_tbps"], "n_records": len(b.doc["records"])}))


def run_compare(b: Bench, args):
    """``--compare``: keep what --out already holds, except its 'compare' rows of the sections
    being re-run."""
    sections = set(filter(None, args.compare.split(",")))
    if sections - COMPARE_OPS.keys():
        raise SystemExit(f"--compare takes {','.join(COMPARE_OPS)}, not {sorted(sections)}")
    if os.path.exists(args.out):
        with open(args.out) as fh:
            old = json.load(fh)
        ops = {COMPARE_OPS[s] for s in sections}
        old["compare"] = [r for r in old.get("compare", []) if r["op"] not in ops]
        b.doc = {**old, "compare_machine": b.doc["machine"],
                 "compare_versions": b.doc["versions"], "compare_command": b.doc["command"]}
    b.doc["compare_copy_tbps"] = round(copy_tbps(args.smoke), 4)
    print("copy TB/s", b.doc["compare_copy_tbps"], flush=True)
    compare(b, sections, args.smoke, args.budget_s)
    print(json.dumps({"compare_rows": len(b.doc["compare"]),
                      "skipped": len(b.doc["compare_skipped"]),
                      "elapsed_s": b.doc["compare_elapsed_s"]}))
    return None


def parse_rotation_args(ap, spec: str, ops_spec: str):
    """``--kv-rotation`` / ``--rotation-ops`` -> (transforms, ops); ``ap.error`` naming what
    works on anything else. An empty ``spec`` -> ((), ops)."""
    from jfp8kv.config import KV_ROTATIONS

    known = [r for r in KV_ROTATIONS if r != "none"]
    rots = [r.strip() for r in spec.split(",") if r.strip()]
    if rots == ["all"]:
        rots = known
    bad = [r for r in rots if r not in known]
    if bad:
        ap.error(f"--kv-rotation: unknown {bad}; give a comma list of {', '.join(known)} or "
                 "'all' (kv_rotation none is always timed as the reference)")
    ops = [o.strip() for o in ops_spec.split(",") if o.strip()]
    if not ops or set(ops) - set(ROTATION_OPS):
        ap.error(f"--rotation-ops: want a comma list of {', '.join(ROTATION_OPS)}, got "
                 f"{ops_spec!r}")
    return tuple(dict.fromkeys(rots)), tuple(dict.fromkeys(ops))


def run_rotation(b: Bench, args, rotations, ops):
    """``--kv-rotation``: keep what --out already holds, except its 'rotation' rows of the
    ops being re-run."""
    if os.path.exists(args.out):
        with open(args.out) as fh:
            old = json.load(fh)
        names = {rotation_op_name(o) for o in ops}
        old["rotation"] = [r for r in old.get("rotation", []) if r["op"] not in names]
        b.doc = {**old, "rotation_machine": b.doc["machine"],
                 "rotation_versions": b.doc["versions"], "rotation_command": b.doc["command"]}
    b.doc["rotation_setup"] = {"kv_rotations": list(rotations), "ops": list(ops),
                               "modes": list(ROTATION_MODES), "budget_s": args.budget_s,
                               "backend": "pallas_interpret" if b.interpret else "pallas"}
    rotation_compare(b, rotations, ops, args.smoke, args.budget_s)
    print(json.dumps({"rotation_rows": len(b.doc["rotation"]),
                      "skipped": len(b.doc["rotation_skipped"]),
                      "elapsed_s": b.doc["rotation_elapsed_s"],
                      "summary": b.doc["rotation_summary"],
                      "phase_summary": b.doc["rotation_phase_summary"]}, indent=1))
    return None


if __name__ == "__main__":
    main()
