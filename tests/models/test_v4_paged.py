"""DeepSeek-V4's forward over the engine's pools (``models.v4_paged``), random tiny preset,
fp8 and bf16 pools: a long chunk (each layer once over all its tokens, the attention in
query blocks) equals the same chunk run as passes over the cache (hidden states and every
pool); decode through the Pallas kernels (interpret mode: sparse attention, indexer scores,
grouped-matmul MoE) equals the jnp path; padding rows write nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kvcache import v4_pools
from jfp8kv.kvcache.cache_tree import Cache
from jfp8kv.kvcache.layout import CachePlan, CacheRequest
from jfp8kv.models import v4_paged
from jfp8kv.models.v4_presets import init_random_params, v4_config

PAGES = jnp.asarray([[3, 1, 4, 0], [5, 2, 6, 7], [0, 0, 0, 0]], jnp.int32)  # row 2: padding
SLOTS = jnp.asarray([2, 1, 0], jnp.int32)


def v4_cache(cfg, spec, num_pages: int, num_slots: int) -> Cache:
    """The engine's V4 pools for ``spec``'s storage and page size (zeros)."""
    layout = v4_pools.v4_layout(cfg, CacheRequest(spec.storage_dtype))
    return Cache.init(CachePlan(layout, spec.page_size, num_pages, num_slots))


@pytest.fixture(scope="module")
def tiny():
    cfg = v4_config("deepseek-v4-tiny")
    spec = v4_pools.V4PoolSpec.from_model(cfg, "fp8_e4m3", 16)
    return cfg, init_random_params(cfg, jax.random.PRNGKey(1), "float32"), spec


def _prefill(cfg, params, spec, ids, lens):
    cache = v4_cache(cfg, spec, 8, 4)
    pos = jnp.zeros((3, ids.shape[1]), jnp.int32)
    return jax.jit(v4_paged.forward, static_argnames=("cfg", "backend"))(
        params, cache, ids, pos, PAGES, lens, SLOTS, cfg=cfg, backend="reference")


def sub_chunked(step, params, cache, tokens, positions, pages, lens, slots, *, cfg, backend,
                sub):
    """The forward as it ran before the layers ran over whole chunks (kept here to compare
    with): the chunk as passes of ``sub`` tokens, each reading the cache the pass before
    wrote and running every layer (its MoE too) over its own tokens. ``step``: the jitted
    ``v4_paged.forward``; the passes share one shape, so one executable serves them all."""
    hs = []
    for s in range(0, tokens.shape[1], sub):
        h, cache = step(params, cache, tokens[:, s:s + sub], positions[:, s:s + sub], pages,
                        lens, slots, cfg=cfg, backend=backend, query_block=None)
        hs.append(h)
    return jnp.concatenate(hs, 1), cache


def assert_stored_close(got, want, max_moved: float = 0.01):
    """A pool leaf in its storage dtype: equal bit for bit but for at most ``max_moved`` of
    its values, each one step of the format away (a float32 last-bit difference that
    crossed a rounding boundary of the storage format)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.isfinite(want.astype(np.float32)).all()
    moved = got != want
    assert moved.mean() <= max_moved, f"{moved.sum()} of {moved.size} values differ"
    gap = np.abs(got[moved].astype(np.float64) - want[moved].astype(np.float64))
    assert (gap <= np.abs(np.spacing(want[moved])).astype(np.float64)).all()


# Four rows after a first chunk of 8 tokens: row 0 from position 5 with 13 real tokens (its
# last block partly padding), row 1 from 8 with all, row 2 fresh (position 0) with 10 (its
# last block all padding at block 4), row 3 padding.
BLOCK_PAGES = jnp.asarray([[3, 1, 4, 0], [5, 2, 6, 7], [8, 9, 10, 11], [0, 0, 0, 0]],
                          jnp.int32)
BLOCK_SLOTS = jnp.asarray([2, 1, 3, 0], jnp.int32)
FIRST = np.asarray([5, 8, 0, 0])


@pytest.mark.parametrize("storage,block,backend,tol", [
    ("fp8_e4m3", 4, "reference", 1e-5), ("bfloat16", 8, "reference", 2e-3),
    ("fp8_e4m3", 4, "pallas_interpret", 1e-5)])
def test_whole_chunk_equals_sub_chunked_passes(storage, block, backend, tol):
    """A chunk of 4 query blocks (each layer once over all its tokens) equals the same chunk
    as 4 passes of a block each over the cache (the forward before whole-chunk layers):
    each query block attends the keys and entries its pass did (later entries masked), the
    compressors pool the same windows whatever the split, and the MoE (grouped by expert
    with ``pallas_interpret``) and the projections are per token. So the real tokens'
    hidden states, the compressor states and the pools agree to float32 rounding, not bit
    for bit: XLA on the CPU rounds the same per-token op differently at another token count
    (an rms_norm over 16 vs 64 rows differs in the last bit). The fp8 pools come out bit
    for bit; in the bf16 pools a few values cross a rounding boundary (one bf16 step) and
    the later tokens reading them move by up to ~5e-4, hence ``tol``. Block 4 is shorter
    than the window's 5 earlier rows, block 8 longer. One block of the whole chunk agrees
    to the same rounding (longer rows of the same softmax)."""
    cfg = v4_config("deepseek-v4-tiny")
    params = init_random_params(cfg, jax.random.PRNGKey(2), "float32")
    spec = v4_pools.V4PoolSpec.from_model(cfg, storage, 16)
    t = 4 * block
    real = np.minimum([13, t, 10, 0], t)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (4, 8 + t)))
    first = jnp.asarray(np.broadcast_to(np.arange(8), (4, 8)), jnp.int32)
    step = jax.jit(v4_paged.forward, static_argnames=("cfg", "backend", "query_block"))
    _, cache = step(params, v4_cache(cfg, spec, 12, 4), ids[:, :8], first,
                    BLOCK_PAGES, jnp.asarray(FIRST, jnp.int32), BLOCK_SLOTS, cfg=cfg,
                    backend="reference")
    pos = jnp.asarray(FIRST[:, None] + np.arange(t)[None], jnp.int32)
    args = (params, cache, ids[:, 8:], pos, BLOCK_PAGES, jnp.asarray(FIRST + real, jnp.int32),
            BLOCK_SLOTS)
    want_h, want_c = sub_chunked(step, *args, cfg=cfg, backend=backend, sub=block)
    blocks = [block, None] if backend == "reference" else [block]
    for query_block in blocks:
        h, c = step(*args, cfg=cfg, backend=backend, query_block=query_block)
        for row, n in enumerate(real):
            assert np.isfinite(np.asarray(h[row, :n])).all()
            np.testing.assert_allclose(h[row, :n], want_h[row, :n], rtol=tol, atol=tol)
        for a, b in zip(jax.tree.leaves(c), jax.tree.leaves(want_c)):
            if a.dtype == jnp.float32:  # compressor state, stats
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
            else:
                assert_stored_close(a, b, 0.0 if storage == "fp8_e4m3" else 0.01)


def test_padding_rows_write_nothing(tiny):
    cfg, params, spec = tiny
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 16)))
    _, c1 = _prefill(cfg, params, spec, ids, jnp.asarray([13, 6, 0], jnp.int32))
    empty = v4_cache(cfg, spec, 8, 4)  # page 0 and slot 0 never written
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
    _, cache = _prefill(cfg, params, spec, ids, lens)
    step = jax.jit(v4_paged.forward, static_argnames=("cfg", "backend"))
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
    per 128-token page) trace through a 2,048-token prefill (four 512-query attention
    blocks) and a 64-row decode step with fp8 pools, abstractly (no weights allocated)."""
    cfg = v4_config("deepseek-v4-flash-4l")
    params = jax.eval_shape(lambda k: init_random_params(cfg, k, "bfloat16"),
                            jax.random.PRNGKey(0))
    spec = v4_pools.V4PoolSpec.from_model(cfg, "fp8_e4m3", 128)
    cache = jax.eval_shape(lambda: v4_cache(cfg, spec, 1490, 66))
    for b, t in ((1, 2048), (64, 1)):
        z = jnp.zeros((b, t), jnp.int32)
        h, out = jax.eval_shape(
            lambda p, c, tok: v4_paged.forward(p, c, tok, tok, jnp.zeros((b, 17), jnp.int32),
                                               tok[:, 0], tok[:, 0], cfg=cfg, backend=backend),
            params, cache, z)
        assert h.shape == (b, t, 4096) and jax.tree.structure(out) == jax.tree.structure(cache)
