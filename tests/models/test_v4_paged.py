"""DeepSeek-V4's forward over the engine's pools (``models.v4_paged``), random tiny preset,
float32, fp8 pools: a long chunk run as a scan over sub-chunks equals one pass (hidden
states and every pool); decode through the Pallas kernels (interpret mode: sparse attention,
indexer scores, grouped-matmul MoE) equals the jnp path; padding rows write nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kvcache import v4_pools
from jfp8kv.kvcache.v4_cache import V4Cache, V4CacheConfig
from jfp8kv.models import v4_paged
from jfp8kv.models.v4_presets import init_random_params, v4_config

PAGES = jnp.asarray([[3, 1, 4, 0], [5, 2, 6, 7], [0, 0, 0, 0]], jnp.int32)  # row 2: padding
SLOTS = jnp.asarray([2, 1, 0], jnp.int32)


@pytest.fixture(scope="module")
def tiny():
    cfg = v4_config("deepseek-v4-tiny")
    spec = v4_pools.V4PoolSpec.from_model(cfg, "fp8_e4m3", 16)
    return cfg, init_random_params(cfg, jax.random.PRNGKey(1), "float32"), spec


def _prefill(cfg, params, spec, ids, lens, sub_chunk):
    cache = V4Cache.init(V4CacheConfig(spec, 8, 4))
    pos = jnp.zeros((3, ids.shape[1]), jnp.int32)
    return jax.jit(v4_paged.forward, static_argnames=("cfg", "backend", "sub_chunk"))(
        params, cache, ids, pos, PAGES, lens, SLOTS, cfg=cfg, backend="reference",
        sub_chunk=sub_chunk)


def test_sub_chunks_equal_one_pass(tiny):
    cfg, params, spec = tiny
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 16)))
    lens = jnp.asarray([13, 6, 0], jnp.int32)
    h1, c1 = _prefill(cfg, params, spec, ids, lens, 16)
    h4, c4 = _prefill(cfg, params, spec, ids, lens, 4)
    for row, n in enumerate([13, 6]):
        np.testing.assert_allclose(h4[row, :n], h1[row, :n], rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(c4), jax.tree.leaves(c1)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-5, atol=1e-5)
    empty = V4Cache.init(V4CacheConfig(spec, 8, 4))  # page 0 and slot 0 never written
    for a, b in zip(jax.tree.leaves(c1), jax.tree.leaves(empty)):
        if a.shape[0] in (8, 4):
            np.testing.assert_array_equal(np.asarray(a[0], np.float32),
                                          np.asarray(b[0], np.float32))


def test_decode_through_kernels_equals_jnp(tiny):
    """Two decode steps at positions 13/6 and 14/7 (windows closing: CSA m = 4, HCA m = 8)
    with backend pallas_interpret equal the reference backend."""
    cfg, params, spec = tiny
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 16)))
    lens = jnp.asarray([13, 6, 0], jnp.int32)
    _, cache = _prefill(cfg, params, spec, ids, lens, 16)
    step = jax.jit(v4_paged.forward, static_argnames=("cfg", "backend", "sub_chunk"))
    caches = {"reference": cache, "pallas_interpret": cache}
    for i in range(2):
        pos = jnp.asarray([[13 + i], [6 + i], [0]], jnp.int32)
        lens = jnp.asarray([14 + i, 7 + i, 0], jnp.int32)
        tok = ids[:, 13 + i:14 + i]
        out = {}
        for backend, c in caches.items():
            out[backend], caches[backend] = step(params, c, tok, pos, PAGES, lens, SLOTS,
                                                 cfg=cfg, backend=backend)
        np.testing.assert_allclose(out["pallas_interpret"][:2], out["reference"][:2],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_flash_widths_trace(backend):
    """``random:deepseek-v4-flash-4l``'s shapes (head_dim 512, 256 experts, one HCA entry
    per 128-token page) trace through a 2,048-token prefill (four 512-token passes) and a
    64-row decode step with fp8 pools, abstractly (no weights allocated)."""
    cfg = v4_config("deepseek-v4-flash-4l")
    params = jax.eval_shape(lambda k: init_random_params(cfg, k, "bfloat16"),
                            jax.random.PRNGKey(0))
    spec = v4_pools.V4PoolSpec.from_model(cfg, "fp8_e4m3", 128)
    cache = jax.eval_shape(lambda: V4Cache.init(V4CacheConfig(spec, 1490, 66)))
    for b, t in ((1, 2048), (64, 1)):
        z = jnp.zeros((b, t), jnp.int32)
        h, out = jax.eval_shape(
            lambda p, c, tok: v4_paged.forward(p, c, tok, tok, jnp.zeros((b, 17), jnp.int32),
                                               tok[:, 0], tok[:, 0], cfg=cfg, backend=backend),
            params, cache, z)
        assert h.shape == (b, t, 4096) and jax.tree.structure(out) == jax.tree.structure(cache)
