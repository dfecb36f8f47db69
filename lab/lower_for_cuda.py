"""Lab: what lowering a forward for an H100 costs, measured on a machine without a GPU.

A GPU start-up traces and lowers every executable it compiles, holding Python's GIL, so its
parallel warm-up wins little from threads (docs/lab/serving-notes.md, "where the compile
time goes"). That part needs no GPU: this lowers ``transformer.forward`` for CUDA on the CPU
(``jit(...).trace(...).lower(lowering_platforms=("cuda",))``) with the kernels routed as on
a Hopper card (the Mosaic GPU prefill kernel where it runs, the Triton ones elsewhere), and
reports the seconds per shape and, with ``--profile``, where they go (cProfile's functions
by cumulative time). Nothing is compiled or run; the weights are shapes only.

    python -m lab.lower_for_cuda [--preset qwen3-8b] [--layers 2,36] [--shapes 1x512,64x1]
        [--storage float8_e4m3fn] [--profile 12] [--out bench/results/lower-for-cuda-cpu.json]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import time

import jax
import numpy as np

from jfp8kv.config import CacheConfig
from jfp8kv.kvcache.cache import KVCache
from jfp8kv.models import transformer


def as_hopper() -> None:
    """Route the ``pallas`` backend's kernels as on an sm_90 card (this process only)."""
    import jfp8kv.kernels as kernels

    kernels.is_hopper = lambda: True


def lower_once(preset: str, layers: int, rows: int, tokens: int, storage: str,
               profile: int = 0, page: int = 16) -> dict:
    """Seconds to trace and lower one forward of ``rows`` x ``tokens`` for CUDA (a fresh
    jit, so nothing is reused from an earlier call but what JAX caches across lowerings),
    whether the Mosaic GPU kernel is in it, and with ``profile`` the top functions."""
    from jfp8kv.config import ModelConfig
    from jfp8kv.models import families
    from jfp8kv.models.presets import PRESETS
    from lab.scan_layers import _inputs

    cfg = ModelConfig(**dict(PRESETS[preset], num_layers=layers), name=f"random:{preset}")
    params = jax.eval_shape(lambda: families.random_params(cfg, jax.random.key(0)))
    num_pages, args = _inputs(cfg, rows, tokens, page, np.random.default_rng())
    ccfg = CacheConfig(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, page, storage,
                       "token" if storage.startswith("float8") else None, bitcast_pool=False)
    cache = jax.eval_shape(lambda: KVCache.init(ccfg))
    fn = jax.jit(functools.partial(transformer.forward, cfg=cfg, backend="pallas"),
                 donate_argnums=1)
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    text = fn.trace(params, cache, *args).lower(lowering_platforms=("cuda",)).as_text()
    if prof:
        prof.disable()
    out = {"preset": preset, "layers": layers, "rows": rows, "tokens": tokens,
           "storage": storage, "lower_s": round(time.perf_counter() - t0, 3),
           "mosaic_gpu": "mosaic_gpu" in text, "triton": "xla.gpu.triton" in text}
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(profile)
        out["profile"] = [line.strip() for line in buf.getvalue().splitlines()
                          if line.strip()[:1].isdigit() and "function calls" not in line]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--layers", default="2,36")
    ap.add_argument("--shapes", default="1x512,64x1",
                    help="rows x tokens of each forward: a prefill chunk, a decode step")
    ap.add_argument("--storage", default="float8_e4m3fn")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also the N functions with the most cumulative time")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    as_hopper()
    rows = []
    for shape in args.shapes.split(","):
        r, t = (int(x) for x in shape.split("x"))
        for n in args.layers.split(","):
            rows.append(lower_once(args.preset, int(n), r, t, args.storage, args.profile))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}))
    if args.out:
        from bench.common import command_line, machine_info, write_result

        write_result(args.out, {"command": command_line("lab.lower_for_cuda", argv),
                                "machine": machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
