"""Calibration's forward pass: run a model over text through an unquantized paged cache and
measure post-RoPE K/V absolute maxima (``KVAmax``, whose policy lives in
``jfp8kv.kvcache.calibrate``). With a K transform (``kv_rotation``) K is measured in the
basis it is stored in; a smoothing transform first measures the K mean (one more pass,
``measure_k_mean``, which is all a dynamic scale mode needs)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jfp8kv.config import CacheConfig
from jfp8kv.engine.runner import ModelRunner
from jfp8kv.kvcache import k_transform
from jfp8kv.kvcache.cache import KVPool
from jfp8kv.kvcache.calibrate import KVAmax, fingerprint, fold_amax, fold_k_sum
from jfp8kv.kvcache.cache_tree import Cache
from jfp8kv.kvcache.layout import CacheLayout, CachePlan


def _run(model_cfg, params, token_chunks, ccfg, k_shift, fold, *, page_size, backend, chunk,
         tp):
    """Run each token list through a float32 paged cache built from ``ccfg`` (chunks of
    ``chunk`` tokens, one sequence at a time, reusing the same pages), calling
    ``fold(cache, num_tokens)`` after each."""
    pool = KVPool(ccfg, ccfg.num_kv_heads // (tp.size if tp else 1))
    plan = CachePlan(CacheLayout(model_cfg.family, "kv", (pool,), storage_dtype="float32",
                                 kv_rotation=ccfg.kv_rotation), page_size, ccfg.num_pages)
    cache = (Cache.init(plan, shardings=tp.cache_shardings(plan.layout)) if tp
             else Cache.init(plan, {"kv": {"k_shift": k_shift}}))
    runner = ModelRunner(model_cfg, params, cache, backend, ccfg.num_pages - 1, tp=tp)
    pages = list(range(1, ccfg.num_pages))
    for ids in token_chunks:
        for s in range(0, len(ids), chunk):
            part = ids[s:s + chunk]
            runner.nll(part, part, s, pages)
        fold(runner.cache["kv"], len(ids))


def _float32_cache(model_cfg, token_chunks, page_size: int, tp) -> CacheConfig:
    """An unquantized cache with one sequence's pages for the longest token list."""
    pages_per_seq = -(-max(len(t) for t in token_chunks) // page_size)
    heads = tp.cache_kv_heads if tp else model_cfg.num_kv_heads
    return CacheConfig(model_cfg.num_layers, heads, model_cfg.head_dim, pages_per_seq + 1,
                       page_size, "float32")


def measure_k_mean(model_cfg, params, token_chunks, *, page_size: int = 16,
                   backend: str = "reference", chunk: int = 512, tp=None) -> np.ndarray:
    """The mean of post-RoPE K over every token of ``token_chunks``, float32 [layers, KV
    heads, head_dim]: a smoothing ``kv_rotation``'s shift, from one pass through a float32
    cache. Dynamic scale modes need nothing else (their scales come at store time)."""
    if tp is not None:
        raise ValueError("smoothing kv_rotation is not supported with tensor parallelism "
                         "yet; use 'none' or 'hadamard'")
    ccfg = _float32_cache(model_cfg, token_chunks, page_size, None)
    k_sum = np.zeros((model_cfg.num_layers, ccfg.num_kv_heads, model_cfg.head_dim), np.float64)
    count = [0]

    def add(cache, n):
        fold_k_sum(cache, n, k_sum)
        count[0] += n

    _run(model_cfg, params, token_chunks, ccfg, None, add, page_size=page_size,
         backend=backend, chunk=chunk, tp=None)
    return (k_sum / count[0]).astype(np.float32)


def measure_amax(model_cfg, params, token_chunks, *, page_size: int = 16,
                 backend: str = "reference", chunk: int = 512, tp=None,
                 kv_rotation: str = "none") -> KVAmax:
    """Run each token list through a float32 paged cache; return the K/V amax over all of
    them, K in the ``kv_rotation`` basis (with ``k_mean`` when it smooths: one more pass,
    ``measure_k_mean``, first). ``tp``: the ``models.sharding`` layout ``params`` are
    placed on (None: one device)."""
    k_transform.validate(kv_rotation, model_cfg.head_dim)
    kw = dict(page_size=page_size, backend=backend, chunk=chunk, tp=tp)
    k_mean = (measure_k_mean(model_cfg, params, token_chunks, **kw)
              if k_transform.smooths(kv_rotation) else None)
    ccfg = _float32_cache(model_cfg, token_chunks, page_size, tp)
    shape = (model_cfg.num_layers, ccfg.num_kv_heads, model_cfg.head_dim)
    k_amax, v_amax = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    _run(model_cfg, params, token_chunks, dataclasses.replace(ccfg, kv_rotation=kv_rotation),
         k_mean, lambda cache, n: fold_amax(cache, n, k_amax, v_amax), **kw)
    r = tp.kv_repeat if tp else 1  # replicated KV heads hold equal copies: keep one each
    return KVAmax(k_amax[:, ::r], v_amax[:, ::r], fingerprint(model_cfg), k_mean=k_mean,
                  kv_rotation=kv_rotation)


def calibrate_on_text(loaded, texts: list[str], **kw) -> KVAmax:
    """``measure_amax`` over ``texts`` tokenized by the loaded model's tokenizer."""
    ids = [loaded.tokenizer.encode(t) for t in texts]
    return measure_amax(loaded.config, loaded.params, ids, **kw)
