"""Lab: the dense forward with its layers under ``lax.scan`` (one layer body compiled) against
``transformer.forward`` (layers unrolled in the HLO), to measure what the start-up would
save before the package changes (docs/lab/serving-notes.md, "where the compile time
goes").

The pools need no kernel change: every layer's pages live in one array with the layers
side by side on the page axis (``[kv_heads, layers x pages, page_size, ...]``, layer ``i``
owning pages ``[i*P, (i+1)*P)`` with its own reserved page ``i*P``), and the scan body adds
``i*P`` to the page tables and ``i*P*page_size`` to the slots. The kernels see one pool of
``layers x P`` pages and write it in place: no layer's pool is sliced out or copied, so the
scanned step's run time is the one the package would have too (``--time``). Per-layer
static scales (tensor, channel) are stacked and sliced, a few bytes each. It computes the
same function (``--check``; tests/lab), with the reference and the Pallas interpret kernels.

Limit for the package: a pool of every layer is one array, so element offsets inside a
kernel reach layers x pages x page_size x head_dim per head (an 8B shape's 30 GB K pool is
over 2^31 elements): kernels must index it with 64-bit offsets or by (layer, page).

    python -m lab.scan_layers [--preset qwen3-0.6b] [--layers 4,28] [--shapes 1x512,64x1]
        [--backend reference] [--check] [--time] [--out bench/results/scan-layers-cpu.json]
"""

from __future__ import annotations

import argparse
import dataclasses
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


def _paged(x) -> bool:
    """Whether a per-layer pool leaf has the page axis (pages, token and block scales): the
    static scale modes' [heads, head_dim] and the unscaled [0] do not."""
    return x.ndim >= 3


def flatten_cache(cache: KVCache) -> tuple:
    """(k, v, k_scale, v_scale) of every layer in one array each: paged leaves with the
    layers side by side on the page axis, the others stacked [L, ...]."""
    def one(xs):
        return jnp.concatenate(xs, axis=1) if _paged(xs[0]) else jnp.stack(xs)
    return tuple(one(xs) for xs in (cache.k, cache.v, cache.k_scale, cache.v_scale))


def forward_scan(params, pools, stats, tokens, positions, slots, page_tables, seq_lens, *,
                 cfg: ModelConfig, cache_cfg: CacheConfig, backend: str = "reference"):
    """``transformer.forward`` of a dense model (no K smoothing) over stacked
    ``params["layers"]`` and ``flatten_cache``'s ``pools`` (k, v, k_scale, v_scale):
    (hidden, pools, stats), the layer body ``transformer.layer_step`` under ``lax.scan``
    seeing one pool of every layer's pages with its page tables and slots moved to layer
    ``i``'s pages."""
    x = params["embed"][tokens]
    ctx = transformer.layer_context(cfg, positions, slots, page_tables, seq_lens, x.dtype)
    per_layer = cache_cfg.num_pages
    flat_cfg = dataclasses.replace(cache_cfg, num_pages=per_layer * cfg.num_layers)
    paged = tuple(_paged(p) and p.shape[1] == flat_cfg.num_pages for p in pools)

    def body(carry, layer_in):
        x, *pools = carry
        lp, i = layer_in
        first = i * per_layer
        here = [p if flat else p[i] for p, flat in zip(pools, paged)]
        layer_ctx = dict(ctx, page_tables=ctx["page_tables"] + first,
                         flat_slots=ctx["flat_slots"] + first * cache_cfg.page_size)
        x, layer, st = transformer.layer_step(x, lp, LayerKV(*here), layer_ctx, cfg=cfg,
                                              cache_cfg=flat_cfg, backend=backend)
        new = (layer.k, layer.v, layer.k_scale, layer.v_scale)
        pools = [n if flat else p.at[i].set(n) for p, n, flat in zip(pools, new, paged)]
        return (x, *pools), st

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


def _median_call_s(fn, args, state: slice, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn``, each fed the donated state (``args``
    at ``state``) the previous call returned."""
    args, times = list(args), []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
        args[state] = out[1:]
    return float(np.median(times[1:]))


def compare(preset: str, layers: int, rows: int, tokens: int, storage: str, check: bool,
            page: int = 16, backend: str = "reference", repeats: int = 0) -> dict:
    """Lower and compile seconds of both forwards at one shape; with ``repeats`` the median
    run seconds of that many calls each (pools donated, as the engine's step); with
    ``check`` their outputs on fresh random weights and inputs (hidden states, every pool,
    the statistics)."""
    from jfp8kv.models.loader import load_model
    from jfp8kv.models.presets import PRESETS

    name = f"{preset}-l{layers}"
    PRESETS[name] = dict(PRESETS[preset], num_layers=layers)
    dtype = "float32" if check else "bfloat16"
    loaded = load_model("random:" + name, dtype)
    cfg = loaded.config
    rng = np.random.default_rng()
    num_pages, args = _inputs(cfg, rows, tokens, page, rng)
    bitcast = backend == "reference" and jax.default_backend() == "cpu"  # as the CPU engine's
    ccfg = CacheConfig(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, page, storage,
                       "token" if storage.startswith("float8") else None, bitcast_pool=bitcast)
    cache = KVCache.init(ccfg)
    unrolled = jax.jit(functools.partial(transformer.forward, cfg=cfg, backend=backend),
                       donate_argnums=1)
    scanned = jax.jit(functools.partial(forward_scan, cfg=cfg, cache_cfg=ccfg,
                                        backend=backend), donate_argnums=(1, 2))
    stacked = stack_layers(loaded.params)
    out = {"preset": preset, "layers": layers, "rows": rows, "tokens": tokens,
           "storage": storage, "backend": backend}
    cases = (("unrolled", unrolled, [loaded.params, cache, *args], slice(1, 2)),
             ("scan", scanned, [stacked, flatten_cache(cache), cache.stats + 0, *args],
              slice(1, 3)))
    results = {}
    for label, fn, fargs, state in cases:
        t0 = time.perf_counter()
        lowered = fn.lower(*fargs)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        out[label] = {"lower_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 3)}
        if check:
            results[label] = compiled(*fargs)
        elif repeats:
            out[label]["run_s"] = _median_call_s(compiled, fargs, state, repeats)
    if check:
        (h0, c0), (h1, pools, stats) = results["unrolled"], results["scan"]
        out["max_abs_hidden"] = float(jnp.max(jnp.abs(h0 - h1)))
        out["pools_max_abs"] = max(float(jnp.max(jnp.abs(
            jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
            for a, b in zip(flatten_cache(c0), pools) if a.size)
        out["stats_max_abs"] = float(jnp.max(jnp.abs(c0.stats - stats)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--layers", default="4,28")
    ap.add_argument("--shapes", default="1x512,64x1",
                    help="rows x tokens of each forward: a prefill chunk, a decode step")
    ap.add_argument("--storage", default="float8_e4m3fn")
    ap.add_argument("--backend", default="reference",
                    help="kernels: reference, pallas (GPU), pallas_interpret")
    ap.add_argument("--check", action="store_true",
                    help="float32 weights and pools, outputs compared")
    ap.add_argument("--time", type=int, default=0, metavar="N",
                    help="also the median run seconds of N calls each (not with --check)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    storage = "float32" if args.check else args.storage  # the same function, compared exactly
    rows = [compare(args.preset, int(n), int(shape.split("x")[0]), int(shape.split("x")[1]),
                    storage, args.check, backend=args.backend, repeats=args.time)
            for shape in args.shapes.split(",") for n in args.layers.split(",")]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        from bench.common import command_line, machine_info, write_result

        write_result(args.out, {"command": command_line("lab.scan_layers", argv),
                                "machine": machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
