"""MLA latent decode kernel benchmark (``jfp8kv.kernels.pallas_mla``) on one GPU.

    python -m bench.mla_kernels --out bench/results/mla-kernels-h200.json [--sweep]
    python -m bench.mla_kernels --dry-run          # the plan only (no JAX work)
    python -m bench.mla_kernels --smoke            # tiny shapes, interpret mode (CPU)
    PYTHONPATH=/tmp/tritonpkg python -m bench.mla_kernels --ptx-stats   # sm_90 code, no GPU
    python -m bench.mla_kernels --compare-mosaic --budget-s 150 \
        --out bench/results/mla-kernels-mosaic-h200.json   # + the Mosaic GPU kernel's rows

Shapes: DeepSeek-V2-Lite's attention (H = 16 absorbed heads, R = 512 + 64), decode
(T = 1) at B = 64 x 4k and B = 8 x 32k tokens of context, for bf16 and fp8_e4m3 latent rows
with token and block scales. Each record: kv_cache_dtype, kv_scale_mode, batch, context,
ms (median; ``bench.kernels.timed``: each timed call runs the op ``reps`` times in one
jitted chain whose iterations depend on each other), tbps = latent bytes (rows + scales
of every visible token, read once) / ms, the issue's metric (target >= 3.0 TB/s on the
H200), and total_tbps with q, the output and page tables added; the tuning used.
``--sweep`` times a small grid of launch knobs per storage first and uses the best. The
JSON ({"machine", "versions", "command", "copy_tbps", "records", "sweep", "ptx_stats"}) is
rewritten after every record. Data is random; every row a sequence sees is distinct.

``--compare-mosaic``: per storage and shape, the Triton kernel's row (default tuning) then
one row per ``MOSAIC_SETTINGS`` entry for ``kernels.mosaic_mla`` (op "mla_decode_mosaic",
``setting``, ``ratio_vs_triton`` = its ms / Triton's), in "compare" (``--mosaic-settings``
picks labels). A setting the kernel refuses (shared memory, a storage it does not run) is
recorded with its error. ``--smoke`` with it: rank 128 + 64 (what the Mosaic kernel takes).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.kernels import chain, timed
from jfp8kv.config import CacheConfig
from jfp8kv.kernels import mosaic_mla, pallas_mla
from jfp8kv.kvcache.cache import bytes_per_token

STORAGES = {"bf16": ("bfloat16", None), "fp8_e4m3:token": ("float8_e4m3fn", "token"),
            "fp8_e4m3:block": ("float8_e4m3fn", "block")}
SHAPES = ((64, 4096), (8, 32768))
SWEEP = dict(block_k=(16, 32, 64), num_warps=(4, 8), num_stages=(2, 3))
# ``--compare-mosaic``: (label, MosaicMLATuning knobs, the storages it runs for). At H = 16
# one head block: tp128 is one wave of 128 programs (B = 64: 2 splits, B = 8: 16), tp132
# (the default) 4 / 32 splits (a ~205 KB program takes a whole SM: one program an SM at a
# time); hb8: two programs of 8 heads per row (the latent read twice, the second mostly from
# L2), where fp8 fits 3 stages. (``st3 alias tp128``, O^T staged in the slots' memory, lost
# to st2 on 2026-12-03 and left the kernel: docs/lab/mla-moe.md.)
BF16, TOKEN, BLOCK = "bf16", "fp8_e4m3:token", "fp8_e4m3:block"
MOSAIC_SETTINGS = (("st2 tp128", dict(target_programs=128), (BF16, TOKEN, BLOCK)),
                   ("st2 tp132", dict(target_programs=132), (BF16,)),
                   ("hb8 st2 tp256", dict(head_block=8, target_programs=256), (BF16,)),
                   ("hb8 st3 tp256", dict(head_block=8, stages=3, target_programs=256),
                    (TOKEN,)))


def mosaic_settings(args, key):
    """The ``MOSAIC_SETTINGS`` entries for storage ``key`` (``--mosaic-settings`` filter:
    those labels for every storage)."""
    if args.mosaic_settings is not None:
        return [(lb, kn) for lb, kn, _ in MOSAIC_SETTINGS if lb in args.mosaic_settings]
    return [(lb, kn) for lb, kn, keys in MOSAIC_SETTINGS if key in keys]


def latent_cfg(storage, mode, rank, rope, batch, context, page_size) -> CacheConfig:
    pages = 1 + batch * -(-context // page_size)
    return CacheConfig(num_layers=1, num_kv_heads=1, head_dim=rank + rope, num_pages=pages,
                       page_size=page_size, storage_dtype=storage, scale_mode=mode,
                       layout="latent")


def make_pool(rng, cfg: CacheConfig, batch: int, context: int):
    """Random latent pages and scales; each sequence gets its own shuffled pages."""
    p, s, width = cfg.num_pages, cfg.page_size, cfg.head_dim
    kp, ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
    x = jax.random.normal(kp, (1, p, s, width), jnp.float32)
    pages = (jnp.clip(x * 60.0, -400, 400) if cfg.is_fp8 else x).astype(cfg.storage_dtype)
    if cfg.scale_mode == "token":
        scale = jax.random.uniform(ks, (1, p, s), jnp.float32, 0.005, 0.02)
    elif cfg.scale_mode == "block":
        scale = jax.random.uniform(ks, (1, p, s, width // cfg.scale_block), jnp.float32,
                                   0.005, 0.02).astype(jnp.float16)
    else:
        scale = jnp.ones((0,), jnp.float32)
    mp = -(-context // s)
    pt = rng.permutation(np.arange(1, p))[: batch * mp].reshape(batch, mp)
    return pages, scale, jnp.asarray(pt, jnp.int32), jnp.full((batch,), context, jnp.int32)


def latent_bytes(cfg: CacheConfig, tokens: int) -> int:
    """Rows and their scales read for ``tokens`` visible tokens (each read once): the cache's
    own per-token byte count for one latent layer."""
    return tokens * bytes_per_token(1, 1, cfg.head_dim, cfg.storage_dtype, cfg.scale_mode,
                                    cfg.scale_block, layout="latent")


def decode_chain(cfg: CacheConfig, rank: int, tuning, interpret: bool, impl: str = "triton"):
    """reps -> jitted (q, pages, scale, pt, lens) running decode reps times (``chain``: each
    q built from the last output, q_{i+1} = q_i + 1e-3 [o_i | 0]); ``impl`` "triton"
    (``pallas_mla``) or "mosaic" (``mosaic_mla``)."""
    sm = 1.0 / float(np.sqrt(cfg.head_dim))
    fn = mosaic_mla.latent_attention if impl == "mosaic" else pallas_mla.latent_attention
    return chain(lambda q, pages, scale, pt, lens: fn(
        q, pages, scale, pt, lens, (lens - 1)[:, None], cfg, sm, rank, interpret=interpret,
        tuning=tuning))


def time_decode(args, rng, key, batch, context, tuning, interpret, impl="triton"):
    storage, mode = STORAGES[key]
    cfg = latent_cfg(storage, mode, args.rank, args.rope, batch, context, args.page_size)
    if impl == "mosaic":
        tuning = tuning or mosaic_mla.MosaicMLATuning()
    rec = dict(op="mla_decode" if impl == "triton" else "mla_decode_mosaic",
               kv_cache_dtype=key.split(":")[0], kv_scale_mode=mode,
               batch=batch, context=context, num_heads=args.heads, kv_lora_rank=args.rank,
               qk_rope_head_dim=args.rope, page_size=args.page_size,
               tuning=dataclasses.asdict(tuning or pallas_mla.default_tuning(cfg)))
    try:
        pages, scale, pt, lens = make_pool(rng, cfg, batch, context)
        q = jax.random.normal(jax.random.key(1), (batch, 1, args.heads, cfg.head_dim),
                              jnp.bfloat16)
        lat = latent_bytes(cfg, batch * context)
        total = lat + q.size * 2 + batch * args.heads * args.rank * 2 + pt.size * 4
        ms, reps = timed(decode_chain(cfg, args.rank, tuning, interpret, impl), q, pages,
                         scale, pt, lens, est_ms=total / 2e9, calls=3 if interpret else 10,
                         max_reps=2 if interpret and impl == "mosaic" else 48)
        rec.update(ms=round(ms, 5), tbps=round(lat / ms / 1e9, 4),
                   total_tbps=round(total / ms / 1e9, 4), latent_bytes=lat, reps=reps)
    except Exception as e:  # noqa: BLE001 - a failed config is recorded, not fatal
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(" ".join(f"{k}={rec[k]}" for k in ("kv_cache_dtype", "kv_scale_mode", "batch",
                                             "context", "ms", "tbps", "error") if k in rec),
          flush=True)
    return rec


def compare_mosaic(args, doc, shapes):
    """``--compare-mosaic``: Triton's row, then the Mosaic kernel's per setting."""
    rng = np.random.default_rng(0)
    t0 = time.time()
    for key in args.storages:
        settings = mosaic_settings(args, key)
        for b, c in shapes:
            if time.time() - t0 > args.budget_s:
                print(f"budget of {args.budget_s} s spent: {key} {b}x{c} not run", flush=True)
                continue
            base = time_decode(args, rng, key, b, c, None, args.smoke)
            base["setting"] = "triton"
            doc["compare"].append(base)
            for label, knobs in settings:
                if time.time() - t0 > args.budget_s:
                    break
                rec = time_decode(args, rng, key, b, c, mosaic_mla.MosaicMLATuning(**knobs),
                                  args.smoke, impl="mosaic")
                rec["setting"] = label
                if "ms" in rec and "ms" in base:
                    rec["ratio_vs_triton"] = round(rec["ms"] / base["ms"], 3)
                print(f"  mosaic {label}: ratio_vs_triton={rec.get('ratio_vs_triton')}",
                      flush=True)
                doc["compare"].append(rec)
                common.write_result(args.out, doc)


def tunings(args):
    """The sweep grid (``--sweep``), else the command line's one tuning (None: default)."""
    if not args.sweep:
        knobs = {k: getattr(args, k) for k in ("block_k", "num_warps", "num_stages", "block_m")
                 if getattr(args, k) is not None}
        if args.variant is not None:
            knobs["variant"] = args.variant
        return [pallas_mla.MLATuning(**knobs)] if knobs else [None]
    return [pallas_mla.MLATuning(block_k=bk, num_warps=nw, num_stages=ns,
                                 variant="pagepf+asm")
            for bk, nw, ns in itertools.product(*SWEEP.values())]


def ptx_stats(args):
    """sm_90 code statistics of the decode kernel per storage (pip Triton, no GPU)."""
    from bench.ptx_stats import capture_ttir, compile_ptx, loop_stats, sass_stats

    out = []
    for key, t in itertools.product(args.storages, tunings(args)):
        storage, mode = STORAGES[key]
        cfg = latent_cfg(storage, mode, args.rank, args.rope, 2, 256, args.page_size)
        t = t or pallas_mla.default_tuning(cfg)
        pages, scale, pt, lens = make_pool(np.random.default_rng(0), cfg, 2, 256)
        q = jnp.zeros((2, 1, args.heads, cfg.head_dim), jnp.bfloat16)
        f = functools.partial(pallas_mla.latent_attention, cfg=cfg, sm_scale=0.1,
                              value_dim=args.rank, tuning=t)
        rec = dict(kernel="mla_decode", kv_cache_dtype=key, tuning=dataclasses.asdict(t))
        try:
            ttirs = capture_ttir(lambda *a: f(*a), q, pages, scale, pt, lens, (lens - 1)[:, None])
            ptx, info, shared, cubin = compile_ptx(ttirs[0], t.num_warps, t.num_stages)
            rec.update(loop_stats(ptx, info), shared_bytes=shared, **sass_stats(cubin))
        except Exception as e:  # noqa: BLE001 - a failed config is a result too
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(rec, flush=True)
        out.append(rec)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/mla-kernels-h200.json")
    ap.add_argument("--storages", default=",".join(STORAGES),
                    type=lambda s: [x for x in s.split(",") if x])
    ap.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES),
                    help="comma list of BATCHxCONTEXT")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    for knob in ("block_k", "num_warps", "num_stages", "block_m"):
        ap.add_argument("--" + knob.replace("_", "-"), type=int, default=None)
    ap.add_argument("--variant", default=None, help="tiles.Variant spelling, e.g. pagepf+asm")
    ap.add_argument("--sweep", action="store_true", help=f"grid {SWEEP}, best per storage")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--ptx-stats", action="store_true", help="sm_90 code stats, no timing")
    ap.add_argument("--compare-mosaic", action="store_true",
                    help="Triton's row and kernels.mosaic_mla's per MOSAIC_SETTINGS entry")
    ap.add_argument("--mosaic-settings", default=None,
                    type=lambda s: [x for x in s.split(",") if x],
                    help="comma list of MOSAIC_SETTINGS labels for every storage (default: "
                    "each storage's own)")
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="--compare-mosaic: no row starts after this many seconds")
    args = ap.parse_args(argv)
    bad = set(args.storages) - set(STORAGES)
    if bad:
        ap.error(f"unknown storages {sorted(bad)}; choose from {list(STORAGES)}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    if args.smoke and args.compare_mosaic:
        # the GPU interpreter on the CPU: XLA's concurrency-optimized scheduler deadlocked
        # the Mosaic kernels' simulated warpgroups (tests/conftest.py turns it off too); the
        # backend starts later, so the flag still applies
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [
            os.environ.get("XLA_FLAGS", ""),
            "--xla_cpu_enable_concurrency_optimized_scheduler=false"]))
    if args.smoke:
        shapes, args.heads, args.rank, args.rope = [(2, 40)], 4, 32, 32
        if args.compare_mosaic:  # the Mosaic kernel takes ranks of 128 columns, RoPE 64
            args.rank, args.rope = 128, 64
    plan = [(k, b, c) for k in args.storages for b, c in shapes]
    if args.dry_run:
        for k, b, c in plan:
            print(f"mla_decode {k} batch={b} context={c} heads={args.heads} "
                  f"R={args.rank}+{args.rope} tunings={len(tunings(args))}"
                  + (f" + mosaic {[lb for lb, _ in mosaic_settings(args, k)]}"
                     if args.compare_mosaic else ""))
        return
    doc = {"machine": common.machine_info(), "command": common.command_line(
        "bench.mla_kernels", argv) if argv is not None else common.command_line(),
        "target_tbps": 3.0, "records": [], "sweep": []}
    doc["versions"] = doc["machine"].pop("versions")
    if args.ptx_stats:
        doc["ptx_stats"] = ptx_stats(args)
        common.write_result(args.out, doc)
        return
    doc["copy_tbps"] = round(common.copy_bandwidth_tbps(), 3)
    if args.compare_mosaic:
        doc["compare"] = []
        compare_mosaic(args, doc, shapes)
        return
    rng = np.random.default_rng(0)
    for key in args.storages:
        best = None
        if args.sweep:
            b, c = shapes[0]
            for t in tunings(args):
                rec = time_decode(args, rng, key, b, c, t, args.smoke)
                doc["sweep"].append(rec)
                common.write_result(args.out, doc)
                if "ms" in rec and (best is None or rec["ms"] < best[0]):
                    best = (rec["ms"], t)
        for b, c in shapes:
            doc["records"].append(time_decode(args, rng, key, b, c, best and best[1],
                                              args.smoke))
            common.write_result(args.out, doc)


if __name__ == "__main__":
    main()
