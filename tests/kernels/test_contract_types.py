"""The jaxtyping annotations of the kernels' contract and the cache pytree are enforced
under pytest (tests/conftest.py installs the checking import hook): a wrong shape or dtype
at a boundary fails at the call, not deep inside a kernel."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jaxtyping import TypeCheckError

from jfp8kv import kernels
from jfp8kv.config import CacheConfig
from jfp8kv.kvcache.cache import KVCache, LayerKV

CFG = CacheConfig(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=5, page_size=16,
                  storage_dtype="float8_e4m3fn", scale_mode="token")


def test_store_rejects_mismatched_rows():
    layer = KVCache.init(CFG).layer(0)
    k = jnp.ones((3, 2, 64), jnp.bfloat16)
    slots = jnp.array([16, 17, 18], jnp.int32)
    kernels.store_kv(layer, k, k, slots, CFG)  # well-formed
    with pytest.raises(TypeCheckError):
        kernels.store_kv(layer, k, k[:, :1], slots, CFG)  # V with one head
    with pytest.raises(TypeCheckError):
        kernels.store_kv(layer, k, k, slots.astype(jnp.float32), CFG)  # float slots


def test_attention_rejects_mismatched_batch():
    layer = KVCache.init(CFG).layer(0)
    q = jnp.ones((3, 1, 4, 64), jnp.bfloat16)
    lens, pos = jnp.ones((3,), jnp.int32), jnp.zeros((3, 1), jnp.int32)
    assert kernels.paged_attention(q, layer, jnp.ones((3, 2), jnp.int32), lens, pos, CFG,
                                   0.125).shape == q.shape
    with pytest.raises(TypeCheckError):
        kernels.paged_attention(q, layer, jnp.ones((2, 2), jnp.int32), lens, pos, CFG, 0.125)


def test_layer_fields_agree():
    layer = KVCache.init(CFG).layer(0)
    with pytest.raises(TypeCheckError):  # token scales of another pool shape
        LayerKV(layer.k, layer.v, layer.k_scale, jnp.ones((2, 5, 8), jnp.float32))
