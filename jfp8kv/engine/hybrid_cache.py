"""The engine side of hybrid models (Qwen3.5/3.6, ``ModelConfig.hybrid``): capacity, cache
and the settings they refuse. ``builder`` calls these; for other models each is a no-op.

Capacity: ``kv_cache_memory`` is the budget of both pools. The DeltaNet state pool
(``kvcache.state_pool``) takes ``max_num_seqs + 2`` slots first (slot 0 the padding sink,
one per running sequence, one scratch slot for ``LLM.nll``), each ``bytes_per_slot``; the
paged K/V of the full-attention layers get the rest, counted by ``cache.bytes_per_token``
over those layers only (``builder.plan_capacity``). The state dtype is the model's
(``HybridFields.state_dtype``: config.json's mamba_ssm_dtype, float32 by default).

Refused, with the reason:

* prefix caching: a cached prefix needs the DeltaNet state after exactly that prefix, and
  the pool keeps one state per running sequence, not snapshots at page boundaries (turned
  off with a warning, since it is on by default);
* static fp8 scale modes without a float ``kv_scales``, and K smoothing: their start-up
  calibration runs the dense model's forward;
* tensor parallelism: the DeltaNet heads are not sharded yet.
"""

from __future__ import annotations

import dataclasses
import logging

from jfp8kv.engine.device_policy import cache_memory
from jfp8kv.kvcache import k_transform, scale_modes
from jfp8kv.kvcache.cache import bytes_per_token
from jfp8kv.kvcache.state_pool import (DeltaState, HybridCache, StateConfig, bytes_per_slot,
                                       state_config)

log = logging.getLogger(__name__)


def engine_state_config(model_cfg, engine) -> StateConfig | None:
    """The state pool of an engine: max_num_seqs + 2 slots (None for non-hybrid models)."""
    if model_cfg.hybrid is None:
        return None
    return state_config(model_cfg.hybrid, engine.max_num_seqs + 2)


def attention_view(model_cfg):
    """``model_cfg`` as the paged cache sees it: its full-attention layers only."""
    return dataclasses.replace(model_cfg, num_layers=len(model_cfg.hybrid.attention_layers),
                               hybrid=None)


def plan_capacity(model_cfg, engine, storage, mode, device, tp, bitcast_pool, kv_rotation):
    """``builder.plan_capacity`` for a hybrid model: the state pool first, pages from the
    rest of the budget. The plan's ``kv_cache_memory`` is the whole budget."""
    from jfp8kv.engine import builder

    if tp is not None:
        raise ValueError(f"tensor_parallel_size > 1 is not supported for {model_cfg.family} "
                         "yet (its DeltaNet heads are not sharded); use 1")
    st = engine_state_config(model_cfg, engine)
    state_bytes = st.num_slots * bytes_per_slot(st)
    attn = attention_view(model_cfg)
    memory = engine.kv_cache_memory
    if memory is None:
        bpt = bytes_per_token(attn.num_layers, attn.num_kv_heads, attn.head_dim, storage, mode)
        max_len = engine.max_model_len or model_cfg.max_position_embeddings
        memory = cache_memory(device, None, bpt, max_len, engine.max_num_seqs)
        memory += state_bytes if device.platform != "gpu" else 0
    if memory <= state_bytes:
        raise ValueError(f"kv_cache_memory={memory} bytes does not hold the DeltaNet state of "
                         f"max_num_seqs={engine.max_num_seqs} sequences ({state_bytes} bytes "
                         f"with the padding and scratch slots); give more or lower max_num_seqs")
    plan = builder.plan_capacity(attn, dataclasses.replace(engine,
                                                           kv_cache_memory=memory - state_bytes),
                                 storage, mode, device, None, bitcast_pool, kv_rotation)
    return dataclasses.replace(plan, kv_cache_memory=memory)


def check_engine(model_cfg, engine, cache_options, mode):
    """``engine`` with what this model cannot do turned off (prefix caching, with a
    warning); ValueError for a cache setting it refuses (see the module docstring)."""
    if model_cfg.hybrid is None:
        return engine
    if k_transform.smooths(cache_options.kv_rotation):
        raise ValueError(f"kv_rotation={cache_options.kv_rotation!r} needs start-up "
                         f"calibration, which {model_cfg.family} does not run yet; use 'none' "
                         "or 'hadamard'")
    if mode is not None and scale_modes.get(mode, "float8_e4m3fn").is_static and not (
            isinstance(cache_options.kv_scales, (int, float))):
        raise ValueError(f"kv_scale_mode={mode!r} needs static scales, and {model_cfg.family} "
                         "cannot calibrate them at start-up yet: pass a float kv_scales, or use "
                         "kv_scale_mode='token' (the default) or 'block'")
    if engine.enable_prefix_caching:
        log.warning("prefix caching is off for %s: a cached prefix would need the DeltaNet "
                    "state after exactly that prefix, and the state pool keeps one state per "
                    "running sequence (docs/qwen3-hybrid.md)", model_cfg.family)
        engine = dataclasses.replace(engine, enable_prefix_caching=False)
    return engine


def with_state(model_cfg, cache, engine):
    """The engine's cache: ``cache`` itself, or for a hybrid model a ``HybridCache`` of it
    and a zeroed state pool."""
    st = engine_state_config(model_cfg, engine)
    return cache if st is None else HybridCache(cache, DeltaState.init(st))


def sequence_slots(model_cfg, engine) -> int:
    """State slots the scheduler hands to sequences (0: none, not a hybrid model)."""
    return 0 if model_cfg.hybrid is None else engine.max_num_seqs


def state_info(built) -> dict:
    """``cache_info`` entries of the state pool (empty for other models); ``pool_bytes``
    there counts both pools, ``kv_pool_bytes`` the pages alone."""
    cache = built.engine.runner.cache
    if not isinstance(cache, HybridCache):
        return {}
    st = cache.state.config
    return dict(kv_pool_bytes=cache.kv.nbytes(), state_dtype=st.dtype,
                state_slots=st.max_seqs, state_bytes_per_slot=bytes_per_slot(st),
                state_pool_bytes=cache.state.nbytes(),
                linear_attention_layers=st.num_layers,
                full_attention_layers=cache.kv.config.num_layers)
