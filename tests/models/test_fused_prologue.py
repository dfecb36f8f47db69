"""The model through the Pallas kernels (interpret mode), with q/k norm and RoPE fused into the
store, equals the model through the reference twins run one by one: a 2-layer Qwen3 shape
(q/k norm, 2 query heads per KV head) in float32, a chunked prefill over non-contiguous
pages then one decode step, for float32 and fp8 token pages (and fp8 with kv_rotation
hadamard: K rotated before the store, the queries inside the attention kernels), and so do
the per-layer stats. (With fp8 pages the attention kernels run their dots in fp16, the
reference in float32: the tolerance is then the GPU end-to-end test's.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.config import CacheConfig, ModelConfig
from jfp8kv.kvcache.cache import KVCache
from jfp8kv.models import families, transformer

CFG = ModelConfig(family="qwen3", vocab_size=128, hidden_size=128, intermediate_size=256,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True,
                  rms_norm_eps=1e-6, rope_theta=1e6)


def _run(params, ccfg, backend, steps):
    fwd = jax.jit(transformer.forward, static_argnames=("cfg", "backend"))
    cache = KVCache.init(ccfg)
    outs = []
    for tokens, positions, slots, tables, lens in steps:
        hidden, cache = fwd(params, cache, tokens, positions, slots, tables, lens, cfg=CFG,
                            backend=backend)
        outs.append(np.asarray(hidden))
    return outs, cache


@pytest.mark.parametrize("storage,mode,rotation", [
    ("float32", None, "none"), ("float8_e4m3fn", "token", "none"),
    ("float8_e4m3fn", "token", "hadamard")])  # K rotated before the store, q in the kernels
def test_pallas_interpret_forward_matches_reference(storage, mode, rotation):
    rng = np.random.default_rng()
    params = families.random_params(CFG, jax.random.key(int(rng.integers(1 << 30))),
                                    jnp.float32, scale=0.1)
    params["layers"] = [{**lp, "q_norm": jnp.asarray(rng.uniform(0.5, 1.5, 64), jnp.float32),
                         "k_norm": jnp.asarray(rng.uniform(0.5, 1.5, 64), jnp.float32)}
                        for lp in params["layers"]]
    s, b = 8, 2
    ccfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, num_pages=12, page_size=s,
                       storage_dtype=storage, scale_mode=mode, kv_rotation=rotation)
    tables = np.zeros((b, 4), np.int32)
    tables[:, :3] = rng.permutation(np.arange(1, 12))[:6].reshape(b, 3)

    def chunk(starts, t, lens):  # the engine's layout: padding lanes at the last position,
        raw = np.asarray(starts)[:, None] + np.arange(t)[None]  # writing into page 0
        valid = raw < np.asarray(lens)[:, None]
        pos = np.where(valid, raw, np.asarray(lens)[:, None] - 1).astype(np.int32)
        slots = np.where(valid, tables[np.arange(b)[:, None], pos // s] * s + pos % s, 0)
        return (jnp.asarray(rng.integers(0, 128, (b, t)), jnp.int32), jnp.asarray(pos),
                jnp.asarray(slots, jnp.int32), jnp.asarray(tables), jnp.asarray(lens, jnp.int32))

    steps = [chunk([0, 0], 12, [12, 12]), chunk([12, 12], 8, [13, 20]),
             chunk([13, 20], 1, [14, 21])]
    with jax.default_matmul_precision("highest"):
        want, want_cache = _run(params, ccfg, "reference", steps)
        got, got_cache = _run(params, ccfg, "pallas_interpret", steps)
    tol = 2e-4 if mode is None else 1e-2
    for g, w in zip(got, want):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())
    # the per-layer stats, reduced from the kernels' per-program rows once per forward:
    # counts exact, amax as close as the layers' K
    gs, ws = np.asarray(got_cache.stats), np.asarray(want_cache.stats)
    np.testing.assert_array_equal(gs[:, :4], ws[:, :4])
    assert (ws[:, 4:] > 0).all()
    np.testing.assert_allclose(gs[:, 4:], ws[:, 4:], rtol=tol)
