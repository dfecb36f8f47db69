"""The one place that maps a model config to its family, and what a family declares: the
cache layout it needs (``kvcache``'s declarations), the forward the engine runs over that
cache, its random weights' shapes, and how its prefill is dispatched. The engine asks
``of(cfg)`` and never which family it runs.

Families:

=========  =====================================  ========================================
family     models                                 cache (``kvcache.layout.CacheLayout``)
=========  =====================================  ========================================
dense      Llama, Qwen2, Qwen3, Qwen3-MoE          K/V pages ("kv")
mla        DeepSeek-V2/V3                         latent rows ("latent")
hybrid     Qwen3.5/3.6 (Gated DeltaNet + MoE)     K/V pages of the attention layers ("kv"),
                                                  DeltaNet state slots ("deltanet")
v4         DeepSeek-V4                            compressed + indexer entries in pages,
                                                  window ring + compressor state in slots
=========  =====================================  ========================================

The forward contract (every family)::

    forward(params, cache: Cache, tokens, positions, slots, page_tables, seq_lens,
            state_slots, *, cfg, backend, tp) -> (hidden [B, T, D] after the final norm,
                                                   cache)

tokens, positions, slots int32[B, T] (padding lanes: slot in page 0), page_tables
int32[B, max_pages], seq_lens int32[B] (cached length after the chunk), state_slots int32[B]
(each row's state slot; slot 0 for padding; unused by families without slot pools), tp a
``sharding.TensorParallel`` or None: the per-device hooks the family's model runs its
kernel sections through (``layers.OneDevice`` on one device). Static: cfg, backend, tp.

Tensor parallelism (``models/sharding.py``): every family splits its query heads; dense and
hybrid K/V pages split on the KV-head axis, the hybrid's DeltaNet states by value head; the
MLA latent and V4's pools are replicated; MoE experts split on their intermediate axis.
``tp_counts(cfg)`` names the counts a mesh size must divide.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from jfp8kv import kernels
from jfp8kv.config import ModelConfig
from jfp8kv.kvcache import cache as kv_cache, latent, state_pool, v4_pools
from jfp8kv.kvcache.cache_tree import Cache
from jfp8kv.kvcache.layout import CacheLayout, CacheRequest, Supports
from jfp8kv.models import mla, qwen3_hybrid, random_weights, transformer, v4_paged, v4_presets

log = logging.getLogger(__name__)


def _dense_forward(params, cache: Cache, tokens, positions, slots, page_tables, seq_lens,
                   state_slots, *, cfg, backend, tp):
    hidden, kv = transformer.forward(params, cache["kv"], tokens, positions, slots,
                                     page_tables, seq_lens, cfg=cfg, backend=backend, par=tp)
    return hidden, cache.replace(kv=kv)


def _mla_forward(params, cache: Cache, tokens, positions, slots, page_tables, seq_lens,
                 state_slots, *, cfg, backend, tp):
    hidden, rows = mla.forward(params, cache["latent"], tokens, positions, slots, page_tables,
                               seq_lens, cfg=cfg, backend=backend, par=tp)
    return hidden, cache.replace(latent=rows)


def _hybrid_forward(params, cache: Cache, tokens, positions, slots, page_tables, seq_lens,
                    state_slots, *, cfg, backend, tp):
    hidden, kv, state = qwen3_hybrid.forward(params, cache["kv"], cache["deltanet"], tokens,
                                             positions, slots, page_tables, seq_lens,
                                             state_slots, cfg=cfg, backend=backend, par=tp)
    return hidden, cache.replace(kv=kv, deltanet=state)


def _v4_forward(params, cache: Cache, tokens, positions, slots, page_tables, seq_lens,
                state_slots, *, cfg, backend, tp):
    return v4_paged.forward(params, cache, tokens, positions, page_tables, seq_lens,
                            state_slots, cfg=cfg, backend=backend, par=tp)


def _heads(cfg: ModelConfig) -> dict[str, int]:
    return {"attention heads": cfg.num_heads}


def _hybrid_counts(cfg: ModelConfig) -> dict[str, int]:
    return {**_heads(cfg), "DeltaNet value heads": cfg.hybrid.linear_num_value_heads}


def _v4_counts(cfg: ModelConfig) -> dict[str, int]:
    return {**_heads(cfg), "output groups (o_groups)": cfg.v4.o_groups}


def _check_kv_kernels(layout: CacheLayout, cfg: ModelConfig, backend: str) -> None:
    kernels.check_kv_cache(layout.pool("kv").config)


def _check_latent_kernels(layout: CacheLayout, cfg: ModelConfig, backend: str) -> None:
    pool = layout.pool("latent").config
    kernels.check_kv_cache(pool)
    kernels.check_latent_cache(pool, cfg.kv_lora_rank, backend)


def _v4_random_params(cfg, key, dtype, layer_shapes, scale=None, sharding_of=None,
                      arrange=None):
    return v4_presets.init_random_params(cfg, key, dtype, sharding_of)


@dataclasses.dataclass(frozen=True)
class Family:
    """What a model family declares (module-level instances: hashable and equal across
    builds). ``declare(cfg, req)`` is its ``kvcache`` layout declaration,
    ``supports`` the ``Supports`` that layout carries (known before any layout is built:
    tensor parallelism is refused at load), ``check_kernels`` the kernels' own refusals of a
    layout on a backend, ``forward`` the contract above, ``layer_shapes(cfg, i)`` the random
    weights' shapes. ``one_row_prefill``: each prefill dispatch holds one row (V4: its
    reference attention's logits and its CSA top-k's scores grow with the rows).
    ``default_max_model_len``: the context when the user names none (None: the model's
    own, as the pool allows). ``tp_counts(cfg)``: the counts (by name) a tensor-parallel
    mesh size must divide (the query heads, and what else the family splits by head)."""

    name: str
    declare: Callable[..., CacheLayout]
    supports: Supports
    forward: Callable
    layer_shapes: Callable | None
    check_kernels: Callable | None = None
    random: Callable = random_weights.init_random_params
    one_row_prefill: bool = False
    default_max_model_len: int | None = None
    tp_counts: Callable = _heads

    def cache_layout(self, cfg: ModelConfig, req: CacheRequest, backend: str) -> CacheLayout:
        """The layout of ``cfg``'s cache for ``req``, checked against ``backend``'s kernels
        (ValueError naming what works)."""
        layout = self.declare(cfg, req)
        if self.check_kernels is not None:
            self.check_kernels(layout, cfg, backend)
        return layout


DENSE = Family("dense", kv_cache.dense_layout, kv_cache.DENSE_SUPPORTS, _dense_forward,
               transformer.layer_shapes, _check_kv_kernels)
MLA = Family("mla", latent.latent_layout, latent.LATENT_SUPPORTS,
             _mla_forward, mla.random_layer_shapes, _check_latent_kernels)
HYBRID = Family("hybrid", state_pool.hybrid_layout, state_pool.HYBRID_SUPPORTS,
                _hybrid_forward, qwen3_hybrid.layer_shapes, _check_kv_kernels,
                tp_counts=_hybrid_counts)
# V4 reads its pools in place (``v4_paged``): a step's work follows its rows' own lengths,
# not the page table's width, so its context is the model's (1M tokens for the presets),
# as far as the pool holds it.
V4 = Family("v4", v4_pools.v4_layout, v4_pools.V4_SUPPORTS, _v4_forward, None,
            random=_v4_random_params, one_row_prefill=True, tp_counts=_v4_counts)


def of(cfg: ModelConfig) -> Family:
    """The family of ``cfg``."""
    if cfg.v4 is not None:
        return V4
    if cfg.hybrid is not None:
        return HYBRID
    if cfg.is_mla:
        return MLA
    return DENSE


def random_params(cfg: ModelConfig, key, dtype="bfloat16", scale: float = 0.02,
                  sharding_of=None, arrange=None) -> dict:
    """Random weights in ``cfg``'s family's params layout (``scale``, ``sharding_of``,
    ``arrange``: see ``random_weights.init_random_params``; DeepSeek-V4's own generator
    takes ``sharding_of`` only)."""
    fam = of(cfg)
    return fam.random(cfg, key, dtype=dtype, layer_shapes=fam.layer_shapes, scale=scale,
                      sharding_of=sharding_of, arrange=arrange)


def forward(params, cache: Cache, tokens, positions, slots, page_tables, seq_lens,
            state_slots=None, *, cfg: ModelConfig, backend: str, tp=None):
    """The forward of ``cfg``'s family (the contract above)."""
    return of(cfg).forward(params, cache, tokens, positions, slots, page_tables, seq_lens,
                           state_slots, cfg=cfg, backend=backend, tp=tp)
