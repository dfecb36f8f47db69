"""DeepSeek-V4 decode kernels (``jfp8kv.kernels.v4_sparse``) and pool capacity, one GPU.

    python -m bench.v4_kernels --out bench/results/v4-kernels-h200.json
    python -m bench.v4_kernels --smoke          # tiny shapes, interpret mode (CPU)

What it answers, at DeepSeek-V4-Flash's attention shapes (64 heads x 512 dims, window 128,
indexer top-512; indexer 64 heads x 128 dims), random data:

* ``sparse_decode`` (the CSA layer's decode attention: 128 window rows + 512 gathered
  compressed entries per sequence) for bf16 and fp8_e4m3 (per-32 fp16 scales) rows, at
  B = 64 sequences of 32k context (8192 compressed entries each in the pool): median ms,
  the bytes of rows + scales read once, TB/s, the max |error| against the jnp twin, and the
  ideal time ratio bf16 / fp8 = 2 / 1.0625 beside the measured one.
* ``indexer_scores`` over every closed entry (8192 bf16 keys per sequence): ms, TB/s, error.
* capacity (no GPU work): pages and tokens that the bf16 and fp8 pools hold in a 64 GiB
  budget with 64 sequence slots, from ``kvcache.v4_pools``'s byte model.

The JSON ({"machine", "command", "records", "capacity"}) is rewritten after every record; a
kernel that fails to lower is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.kernels import chain
from jfp8kv.kernels import v4_sparse
from jfp8kv.kvcache import fp8, v4_pools
from jfp8kv.kvcache.layout import CacheRequest, plan_cache
from jfp8kv.models.v4_presets import v4_config

FULL = dict(batch=64, heads=64, dim=512, window=128, topk=512, entries=8192, i_heads=64,
            i_dim=128)
SMOKE = dict(batch=2, heads=5, dim=64, window=6, topk=7, entries=40, i_heads=20, i_dim=32)


def _median_ms(f, *args, calls: int = 10) -> float:
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    samples = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def _decode_case(s, storage, key):
    k = jax.random.split(key, 5)
    b, d = s["batch"], s["dim"]
    q = jax.random.normal(k[0], (b, s["heads"], d), jnp.float32)
    win, ws = v4_pools.store_rows(jax.random.normal(k[1], (b, s["window"], d)) * 3, storage)
    comp, cs = v4_pools.store_rows(
        jax.random.normal(k[2], (b * s["entries"], d)) * 3, storage)
    idx = jax.random.randint(k[3], (b, s["topk"]), 0, s["entries"]) + (
        s["entries"] * jnp.arange(b)[:, None])
    sinks = jax.random.normal(k[4], (s["heads"],))
    win_len = jnp.full((b,), s["window"], jnp.int32)
    return q, win, ws, win_len, comp, cs, idx.astype(jnp.int32), sinks


def decode_record(s, storage, interpret, key) -> dict:
    args = _decode_case(s, storage, key)
    scale = s["dim"] ** -0.5
    rec = {"op": "sparse_decode", "storage": storage, **{k: s[k] for k in
                                                         ("batch", "heads", "dim", "window",
                                                          "topk")}}
    spec_bytes = s["dim"] * jnp.dtype(storage).itemsize + (
        s["dim"] // 32 * 2 if storage.startswith("float8") else 0)
    rec["bytes"] = s["batch"] * (s["window"] + s["topk"]) * spec_bytes
    try:
        ref = v4_sparse.sparse_decode_reference(*args, scale)
        got = v4_sparse.sparse_decode(*args, scale, interpret=interpret)
        rec["max_abs_err"] = float(jnp.max(jnp.abs(got - ref)))

        def one(q, *rest):
            return v4_sparse.sparse_decode(q, *rest, scale, interpret=interpret)

        reps = 8
        rec["ms"] = _median_ms(chain(one)(reps), *args) / reps
        rec["tbps"] = rec["bytes"] / rec["ms"] / 1e9
    except Exception as e:  # noqa: BLE001  recorded, the run goes on
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return rec


def indexer_record(s, interpret, key) -> dict:
    k = jax.random.split(key, 3)
    b = s["batch"]
    q = jax.random.normal(k[0], (b, s["i_heads"], s["i_dim"]), jnp.float32)
    w = jax.random.normal(k[1], (b, s["i_heads"]), jnp.float32)
    keys = jax.random.normal(k[2], (b, s["entries"], s["i_dim"])).astype(jnp.bfloat16)
    rec = {"op": "indexer_scores", "batch": b, "i_heads": s["i_heads"], "i_dim": s["i_dim"],
           "entries": s["entries"], "bytes": keys.nbytes}
    try:
        ref = v4_sparse.indexer_scores_reference(q, w, keys)
        f = jax.jit(lambda q, w, k: v4_sparse.indexer_scores(q, w, k, interpret=interpret))
        rec["max_abs_err"] = float(jnp.max(jnp.abs(f(q, w, keys) - ref)))
        rec["ms"] = _median_ms(f, q, w, keys)
        rec["tbps"] = rec["bytes"] / rec["ms"] / 1e9
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return rec


def capacity(budget: int = 64 << 30, seqs: int = 64) -> dict:
    cfg = v4_config("deepseek-v4-flash")
    out = {"budget_bytes": budget, "max_num_seqs": seqs}
    for name in ("auto", "fp8_e4m3"):
        layout = v4_pools.v4_layout(cfg, CacheRequest(fp8.storage_dtype_name(name, "bfloat16")))
        plan = plan_cache(layout, budget, 256, seqs, 256)
        out[name] = {"pages": plan.num_pages, "max_tokens": plan.max_tokens,
                     "bytes_per_token": float(layout.bytes_per_token(256)),
                     **plan.pool_bytes()}
    out["token_ratio"] = out["fp8_e4m3"]["max_tokens"] / out["auto"]["max_tokens"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/v4-kernels-h200.json")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    shapes, interpret = (SMOKE, True) if a.smoke else (FULL, False)
    doc = {"machine": common.machine_info(), "command": common.command_line("bench.v4_kernels",
                                                                             argv),
           "capacity": capacity(), "records": []}
    key = jax.random.key(0)
    for storage in ("bfloat16", "float8_e4m3fn"):
        doc["records"].append(decode_record(shapes, storage, interpret, key))
        common.write_result(a.out, doc)
    ms = {r["storage"]: r.get("ms") for r in doc["records"]}
    if all(ms.values()):
        doc["decode_ratio"] = {"measured_bf16_over_fp8": ms["bfloat16"] / ms["float8_e4m3fn"],
                               "ideal": 2 / 1.0625}
    doc["records"].append(indexer_record(shapes, interpret, key))
    common.write_result(a.out, doc)
    print(doc)


if __name__ == "__main__":
    main()
