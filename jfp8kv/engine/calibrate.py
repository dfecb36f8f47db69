"""Calibration's forward pass: run a model over text through an unquantized paged cache and
measure post-RoPE K/V absolute maxima (``KVAmax``, whose policy lives in
``jfp8kv.kvcache.calibrate``)."""

from __future__ import annotations

import numpy as np

from jfp8kv.config import CacheConfig
from jfp8kv.engine.runner import ModelRunner
from jfp8kv.kvcache.cache import KVCache
from jfp8kv.kvcache.calibrate import KVAmax, fingerprint, fold_amax


def measure_amax(model_cfg, params, token_chunks, *, page_size: int = 16,
                 backend: str = "reference", chunk: int = 512, tp=None) -> KVAmax:
    """Run each token list through a float32 paged cache (chunks of ``chunk`` tokens, one
    sequence at a time, reusing the same pages); return the K/V amax over all of them.
    ``tp``: the ``models.sharding`` layout ``params`` are placed on (None: one device)."""
    longest = max(len(t) for t in token_chunks)
    pages_per_seq = -(-longest // page_size)
    heads = tp.cache_kv_heads if tp else model_cfg.num_kv_heads
    ccfg = CacheConfig(model_cfg.num_layers, heads, model_cfg.head_dim, pages_per_seq + 1,
                       page_size, "float32")
    cache = tp.init_cache(ccfg) if tp else KVCache.init(ccfg)
    runner = ModelRunner(model_cfg, params, cache, backend, pages_per_seq, tp=tp)
    pages = list(range(1, pages_per_seq + 1))
    shape = (model_cfg.num_layers, heads, model_cfg.head_dim)
    k_amax, v_amax = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    for ids in token_chunks:
        for s in range(0, len(ids), chunk):
            part = ids[s:s + chunk]
            runner.nll(part, part, s, pages)
        fold_amax(runner.cache, len(ids), k_amax, v_amax)
    r = tp.kv_repeat if tp else 1  # replicated KV heads hold equal copies: keep one each
    return KVAmax(k_amax[:, ::r], v_amax[:, ::r], fingerprint(model_cfg))


def calibrate_on_text(loaded, texts: list[str], **kw) -> KVAmax:
    """``measure_amax`` over ``texts`` tokenized by the loaded model's tokenizer."""
    ids = [loaded.tokenizer.encode(t) for t in texts]
    return measure_amax(loaded.config, loaded.params, ids, **kw)
