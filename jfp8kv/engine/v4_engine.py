"""The engine side of DeepSeek-V4 (``ModelConfig.v4``): settings, capacity and cache.
``builder`` calls these; for other models each is a no-op.

Capacity: ``kv_cache_memory`` is the budget of all four pools (``kvcache.v4_pools``). The
per-sequence pools (window ring + float32 compressor state) take ``max_num_seqs + 2``
slots first (slot 0 the padding sink, one per running sequence, one scratch slot for
``LLM.nll``); the pages (compressed + indexer entries of ``page_size`` source tokens) get
the rest, counted by the same ``V4PoolSpec`` byte functions ``init_pools`` allocates from,
with the storage dtype decided first (fp8: e4m3 + float16 per-32 scales; else bf16).

Settings it changes or refuses, with the reason:

* ``page_size`` not a multiple of every compress ratio: raised to the smallest power of
  two that is (128 for Flash: its HCA ratio), with a log line; an entry never straddles pages;
* ``max_model_len`` unset: ``DEFAULT_MAX_MODEL_LEN`` rather than the 1M-token context (each
  step gathers every visible compressed entry of a row densely, so the context costs);
* prefix caching: turned off with a warning (it is on by default, so an explicit request
  cannot be told from the default): a cached prefix would need the compressor state after
  exactly that prefix, and the slot pool keeps one state per running sequence;
* ``kv_scale_mode`` other than block, ``kv_rotation``, ``kv_scales``, tensor parallelism:
  ValueError naming what works.
"""

from __future__ import annotations

import dataclasses
import logging

from jfp8kv.engine.device_policy import cache_memory
from jfp8kv.kvcache import fp8, v4_pools
from jfp8kv.kvcache.v4_cache import V4Cache, V4CacheConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192


def _page_size(model_cfg, page_size: int) -> int:
    ratios = [r for r in model_cfg.v4.compress_ratios if r]
    ps = page_size
    while any(ps % r for r in ratios):
        ps *= 2
        if ps > 128:  # EngineConfig's largest page
            raise ValueError(f"no page size up to 128 tokens holds whole windows of the compress "
                             f"ratios {sorted(set(ratios))}; DeepSeek-V4 needs power-of-two "
                             "ratios of at most 128")
    if ps != page_size:
        log.info("page_size %d -> %d for %s: a page must hold whole compressed windows "
                 "(compress ratios %s)", page_size, ps, model_cfg.name, sorted(set(ratios)))
    return ps


def check_engine(model_cfg, engine, cache_options):
    """``engine`` adjusted for V4 (page size, max_model_len, prefix caching off); ValueError
    for what V4 cannot do. Other models: ``engine`` unchanged."""
    if model_cfg.v4 is None:
        return engine
    if engine.tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size={engine.tensor_parallel_size}: DeepSeek-V4 "
                         "runs on one device (its heads and pools are not sharded); use 1")
    bad = [f"{n}={v!r}" for n, v, ok in (
        ("kv_scale_mode", cache_options.kv_scale_mode, (None, "block")),
        ("kv_rotation", cache_options.kv_rotation, ("none",)),
        ("kv_scales", cache_options.kv_scales, (None,))) if v not in ok]
    if bad:
        raise ValueError(f"{', '.join(bad)}: DeepSeek-V4's fp8 pools use block scales "
                         "(one float16 per 32 channels, computed at store time) and no K "
                         "transform; leave kv_scale_mode unset (or 'block'), kv_rotation "
                         "'none' and kv_scales unset")
    v4_pools.V4PoolSpec.from_model(model_cfg, pool_dtype(cache_options.kv_cache_dtype),
                                   _page_size(model_cfg, engine.page_size))  # dtype check
    if engine.enable_prefix_caching:
        log.warning("prefix caching is off for %s: a cached prefix would need the compressor "
                    "state after exactly that prefix, and the slot pool keeps one state per "
                    "running sequence (docs/deepseek-v4.md)", model_cfg.family)
    return dataclasses.replace(
        engine, enable_prefix_caching=False, page_size=_page_size(model_cfg, engine.page_size),
        max_model_len=engine.max_model_len or min(DEFAULT_MAX_MODEL_LEN,
                                                  model_cfg.max_position_embeddings))


def pool_dtype(kv_cache_dtype: str) -> str:
    """The window / compressed pools' dtype of a ``--kv-cache-dtype``: fp8 -> e4m3 (the V4
    pools have no e5m2), anything else bf16 (``auto`` means bf16 pools for V4)."""
    try:
        name = fp8.storage_dtype_name(kv_cache_dtype, "bfloat16")
    except ValueError:
        name = kv_cache_dtype  # already a storage dtype name (the builder's resolved one)
    if name == "float8_e5m2":
        raise ValueError("DeepSeek-V4 pools store fp8 as e4m3 only; use --kv-cache-dtype "
                         "fp8_e4m3 or auto")
    return "fp8_e4m3" if fp8.is_fp8(name) else "auto"


def plan_capacity(model_cfg, engine, kv_cache_dtype: str, device):
    """``builder.CapacityPlan`` for V4: slots first, pages from the rest of the budget;
    ValueError when one max_model_len sequence does not fit."""
    from jfp8kv.engine.builder import CapacityPlan

    spec = v4_pools.V4PoolSpec.from_model(model_cfg, pool_dtype(kv_cache_dtype),
                                          engine.page_size)
    slots = engine.max_num_seqs + 2
    max_len = engine.max_model_len
    memory = engine.kv_cache_memory
    if memory is None:
        bpt = -(-spec.bytes_per_page() // spec.page_size)
        memory = cache_memory(device, None, bpt, max_len, engine.max_num_seqs)
        memory += slots * spec.bytes_per_slot() if device.platform != "gpu" else 0
    pages = v4_pools.plan(spec, memory, slots)
    if (pages - 1) * spec.page_size < max_len:
        need = slots * spec.bytes_per_slot() + (-(-max_len // spec.page_size) + 1) * \
            spec.bytes_per_page()
        raise ValueError(f"kv_cache_memory={memory} bytes holds {(pages - 1) * spec.page_size} "
                         f"DeepSeek-V4 tokens after {slots} sequence slots, fewer than one "
                         f"sequence of max_model_len={max_len}; give at least {need} bytes, "
                         "lower max_model_len or max_num_seqs")
    return CapacityPlan(V4CacheConfig(spec, pages, slots), max_len, memory,
                        float(spec.bytes_per_token()))


def init_cache(ccfg):
    """The zeroed ``V4Cache`` of a V4 plan's config (None for another config)."""
    return V4Cache.init(ccfg) if isinstance(ccfg, V4CacheConfig) else None


def sequence_slots(model_cfg, engine) -> int:
    """Slots the scheduler hands to sequences (0: not V4)."""
    return 0 if model_cfg.v4 is None else engine.max_num_seqs


def pool_info(built) -> dict:
    """``cache_info`` entries of the V4 pools (empty for other models): each pool's bytes,
    the per-slot and per-page bytes of the byte model, slots."""
    cache = built.engine.runner.cache
    if not isinstance(cache, V4Cache):
        return {}
    spec = cache.config.spec
    return dict(v4_pool_bytes=cache.pool_nbytes(), v4_state_slots=cache.config.num_slots - 2,
                v4_bytes_per_slot=spec.bytes_per_slot(), v4_bytes_per_page=spec.bytes_per_page(),
                v4_indexer_dtype=v4_pools.INDEXER_DTYPE, v4_state_dtype=v4_pools.STATE_DTYPE)
