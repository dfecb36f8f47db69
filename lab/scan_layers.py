"""Lab: the dense forward with its layers under ``lax.scan`` (one layer body compiled) against
``transformer.forward`` (layers unrolled in the HLO), to measure what the start-up would
save before the package changes (docs/lab/serving-notes.md, "compile time follows the
layer count").

Not the engine's path: the layer's pools are sliced out of stacked [L, ...] arrays and
written back with ``.at[i].set`` in the scan's carry, which on a GPU would copy a layer's
pool per step unless the kernels took the stacked pool and the layer index. It computes the
same function (``python -m lab.scan_layers --check``; tests/lab), so its compile time is
the one a real scan would have, its run time is not.

    python -m lab.scan_layers [--preset qwen3-0.6b] [--layers 4,28] [--shapes 1x512,64x1]
        [--check] [--out bench/results/scan-layers-cpu.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jfp8kv.config import CacheConfig, ModelConfig
from jfp8kv.kernels.prologue import rms_norm
from jfp8kv.kvcache.cache import KVCache, LayerKV, accumulate_stats, reduce_stat_rows
from jfp8kv.models import transformer


def stack_layers(params: dict) -> dict:
    """``params`` with its per-layer list stacked into [L, ...] arrays (once, outside jit)."""
    return dict(params, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"]))


def stack_cache(cache: KVCache) -> tuple:
    return tuple(jnp.stack(xs) for xs in (cache.k, cache.v, cache.k_scale, cache.v_scale))


def forward_scan(params, pools, stats, tokens, positions, slots, page_tables, seq_lens, *,
                 cfg: ModelConfig, cache_cfg: CacheConfig, backend: str = "reference"):
    """``transformer.forward`` of a dense model (no K smoothing) over stacked
    ``params["layers"]`` and stacked ``pools`` (k, v, k_scale, v_scale): (hidden, pools,
    stats), the layer body ``transformer.layer_step`` under ``lax.scan``."""
    x = params["embed"][tokens]
    ctx = transformer.layer_context(cfg, positions, slots, page_tables, seq_lens, x.dtype)

    def body(carry, layer_in):
        x, k_all, v_all, ks_all, vs_all = carry
        lp, i = layer_in
        layer = LayerKV(k_all[i], v_all[i], ks_all[i], vs_all[i])
        x, layer, st = transformer.layer_step(x, lp, layer, ctx, cfg=cfg, cache_cfg=cache_cfg,
                                              backend=backend)
        carry = (x, k_all.at[i].set(layer.k), v_all.at[i].set(layer.v),
                 ks_all.at[i].set(layer.k_scale), vs_all.at[i].set(layer.v_scale))
        return carry, st

    (x, *pools), st = jax.lax.scan(body, (x, *pools),
                                   (params["layers"], jnp.arange(cfg.num_layers)))
    stats = accumulate_stats(stats, reduce_stat_rows(st))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), tuple(pools), stats


def _inputs(cfg: ModelConfig, rows: int, tokens: int, page: int, rng):
    pages_per_row = -(-tokens // page)
    num_pages = rows * pages_per_row + 1
    tok = rng.integers(0, cfg.vocab_size, (rows, tokens)).astype(np.int32)
    pos = np.tile(np.arange(tokens, dtype=np.int32), (rows, 1))
    pt = (1 + np.arange(rows * pages_per_row, dtype=np.int32)).reshape(rows, pages_per_row)
    slots = (pt[:, pos[0] // page] * page + pos[0] % page).astype(np.int32)
    lens = np.full(rows, tokens, np.int32)
    return num_pages, (tok, pos, slots, pt, lens)


def compare(preset: str, layers: int, rows: int, tokens: int, storage: str, check: bool,
            page: int = 16) -> dict:
    """Compile seconds of both forwards at one shape (and with ``check`` their outputs on
    fresh random weights and inputs: hidden states and every pool equal)."""
    from jfp8kv.models.loader import load_model
    from jfp8kv.models.presets import PRESETS

    name = f"{preset}-l{layers}"
    PRESETS[name] = dict(PRESETS[preset], num_layers=layers)
    dtype = "float32" if check else "bfloat16"
    loaded = load_model("random:" + name, dtype)
    cfg = loaded.config
    rng = np.random.default_rng()
    num_pages, args = _inputs(cfg, rows, tokens, page, rng)
    ccfg = CacheConfig(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, page, storage,
                       "token" if storage.startswith("float8") else None,
                       bitcast_pool=jax.default_backend() == "cpu")  # as the CPU engine's
    cache = KVCache.init(ccfg)
    unrolled = jax.jit(functools.partial(transformer.forward, cfg=cfg))
    scanned = jax.jit(functools.partial(forward_scan, cfg=cfg, cache_cfg=ccfg))
    stacked = stack_layers(loaded.params)
    out = {"preset": preset, "layers": layers, "rows": rows, "tokens": tokens,
           "storage": storage}
    for label, fn, fargs in (("unrolled", unrolled, (loaded.params, cache, *args)),
                             ("scan", scanned, (stacked, stack_cache(cache), cache.stats,
                                                *args))):
        t0 = time.perf_counter()
        lowered = fn.lower(*fargs)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        out[label] = {"lower_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 3)}
        if check:
            out[label]["result"] = compiled(*fargs)
    if check:
        (h0, c0), (h1, pools, stats) = out["unrolled"].pop("result"), out["scan"].pop("result")
        ref = stack_cache(c0)
        out["max_abs_hidden"] = float(jnp.max(jnp.abs(h0 - h1)))
        out["pools_max_abs"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(ref, pools)
                                   if a.size)
        out["stats_max_abs"] = float(jnp.max(jnp.abs(c0.stats - stats)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--layers", default="4,28")
    ap.add_argument("--shapes", default="1x512,64x1",
                    help="rows x tokens of each forward: a prefill chunk, a decode step")
    ap.add_argument("--storage", default="float8_e4m3fn")
    ap.add_argument("--check", action="store_true",
                    help="float32 weights and pools, outputs compared")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    storage = "float32" if args.check else args.storage  # the same function, compared exactly
    rows = [compare(args.preset, int(n), int(shape.split("x")[0]), int(shape.split("x")[1]),
                    storage, args.check)
            for shape in args.shapes.split(",") for n in args.layers.split(",")]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        from bench.common import command_line, machine_info, write_result

        write_result(args.out, {"command": command_line("lab.scan_layers", argv),
                                "machine": machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
