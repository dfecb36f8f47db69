"""The planner keeps the golden capacity table (``golden_capacity.py``): pages, slots, bytes
per token and every pool's bytes, for each family x cache dtype x scale mode at fixed budgets.
Pure Python and shapes: nothing is allocated, no engine is built."""

from __future__ import annotations

import json

import jax
import pytest

from tests.kvcache.golden_capacity import GOLDEN, MAX_MODEL_LEN, cases, key, model_config


def capacity_row(preset: str, kv: str, mode: str | None, budget: int, seqs: int) -> dict:
    """One row of the table from today's planner (pools sized by shape, not allocated)."""
    from jfp8kv.config import EngineConfig
    from jfp8kv.engine import builder, hybrid_cache, v4_engine
    from jfp8kv.kvcache import fp8
    from jfp8kv.kvcache.cache import KVCache
    from jfp8kv.kvcache.state_pool import HybridCache
    from jfp8kv.kvcache.v4_cache import V4Cache

    cfg = model_config(preset)
    engine = EngineConfig(max_model_len=MAX_MODEL_LEN, kv_cache_memory=budget,
                          max_num_seqs=seqs)
    if cfg.v4 is not None:
        from jfp8kv.config import CacheOptions

        engine = v4_engine.check_engine(cfg, engine, CacheOptions(kv_cache_dtype=kv))
    storage = fp8.storage_dtype_name(kv, "bfloat16")
    if cfg.is_mla and mode is None and fp8.is_fp8(storage):
        mode = "block"
    try:
        plan = builder.plan_capacity(cfg, engine, storage, mode, jax.devices("cpu")[0])
    except ValueError:
        return {"refused": True}
    ccfg = plan.cache_config
    if cfg.v4 is not None:
        cache = jax.eval_shape(lambda: V4Cache.init(ccfg))
        pools = {"window": cache.window, "compressed": cache.compressed,
                 "indexer": cache.indexer, "compressor": cache.state}
        slots = ccfg.num_slots
    else:
        static = None
        if mode in ("tensor", "channel"):
            static = jax.numpy.ones((ccfg.num_layers, cfg.num_kv_heads, ccfg.head_dim))
        cache = jax.eval_shape(lambda: hybrid_cache.with_state(
            cfg, KVCache.init(ccfg, static, static), engine))
        kvc = cache.kv if isinstance(cache, HybridCache) else cache
        pools = {"latent" if ccfg.layout == "latent" else "kv":
                 (kvc.k, kvc.v, kvc.k_scale, kvc.v_scale)}
        slots = 0
        if isinstance(cache, HybridCache):
            pools["deltanet"] = (cache.state.conv, cache.state.recurrent)
            slots = cache.state.config.num_slots
    nbytes = {name: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(p))
              for name, p in pools.items()}
    return {"pages": ccfg.num_pages, "slots": slots, "page_size": ccfg.page_size,
            "bytes_per_token": float(plan.bytes_per_token), "pool_bytes": nbytes}


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: key(*c[:1], *c[2:]))
def test_planner_keeps_the_golden_capacity(case, golden):
    preset, _, kv, mode, budget, seqs = case
    assert capacity_row(preset, kv, mode, budget, seqs) == golden[key(preset, kv, mode, budget,
                                                                      seqs)]
