"""Integer page pools (``CacheConfig.bitcast_pool``, the CPU representation) hold exactly the
bits of the float pools: the reference store writes the same bits, and the read path
(``gather_dequantized``, ``paged_attention``) returns the same values, for every storage
dtype and scale mode, NaN rows, infinities and saturating values included.

Bits are compared with NaN == NaN (see ``assert_same``). Both pools are poisoned (NaN pages and dynamic scales) before the store, so a slot the store
misses shows up as NaN in both, and a slot it writes cannot match by accident.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.config import CacheConfig
from jfp8kv.kernels import reference
from jfp8kv.kvcache.cache import KVCache, as_pool, as_storage, pool_dtype

H, D, S, P = 2, 64, 8, 17  # heads, head_dim, page_size, pages (page 0 = padding sink)
CASES = ([("float8_e4m3fn", m) for m in ("tensor", "channel", "token", "block")]
         + [("float8_e5m2", m) for m in ("tensor", "token", "block")]
         + [("bfloat16", None), ("float16", None), ("float32", None)])
POOL = {"float8_e4m3fn": "uint8", "float8_e5m2": "uint8", "bfloat16": "uint16",
        "float16": "uint16", "float32": "float32"}
store = jax.jit(reference.store_kv, static_argnums=4)
attend = jax.jit(reference.paged_attention, static_argnums=(5, 6))
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def poisoned(cfg: CacheConfig, static):
    """Layer 0 of a fresh pool of ``cfg``'s representation, pages and dynamic scales NaN."""
    layer = KVCache.init(cfg, static, static).layer(0)
    nan_pages = as_pool(jnp.full(layer.k.shape, jnp.nan, jnp.float32), cfg)
    layer.k, layer.v = nan_pages, nan_pages
    if cfg.scale_mode in ("token", "block"):
        layer.k_scale = layer.v_scale = jnp.full(layer.k_scale.shape, jnp.nan,
                                                 layer.k_scale.dtype)
    return layer


def rows(rng, n: int) -> np.ndarray:
    """Rows [n, H, D] with a NaN row, scattered NaN/+-inf, and values far beyond fp8 range."""
    x = (rng.standard_normal((n, H, D)) * 2.0 ** rng.integers(-12, 12, (n, H, 1)))
    x[1] = np.nan  # a whole NaN row
    x[2, 0, 3] = np.nan
    x[3, 1, 7], x[4, 0, 0] = np.inf, -np.inf
    x[5] *= 1e6  # saturates every static scale below 1e3
    return x.astype(np.float32)


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same(got, want, what: str) -> None:
    """Same bits, NaN == NaN whatever its payload (XLA's float pool update round-trips the
    whole pool through float32, which may change the payload of NaNs it did not write)."""
    gn, wn = (np.isnan(np.asarray(x).astype(np.float32)) for x in (got, want))
    np.testing.assert_array_equal(gn, wn, err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.where(gn, 0, bits(got)), np.where(wn, 0, bits(want)),
                                  err_msg=what)


@pytest.mark.parametrize("storage,mode", CASES)
def test_integer_pool_equals_float_pool_bit_for_bit(storage, mode):
    rng = np.random.default_rng()
    flt = CacheConfig(1, H, D, P, S, storage, mode)
    itg = dataclasses.replace(flt, bitcast_pool=True)
    assert pool_dtype(itg) == jnp.dtype(POOL[storage]) and pool_dtype(flt) == storage
    static = None
    if mode in ("tensor", "channel"):
        static = (2.0 ** rng.integers(-4, 4, (1, H, 1 if mode == "tensor" else D)))
        static = np.broadcast_to(static, (1, H, D)).astype(np.float32)
    n, n_real = 24, 20
    k, v = rows(rng, n), rows(rng, n)[::-1].copy()
    slots = np.concatenate([rng.permutation((P - 1) * S)[:n_real] + S,
                            rng.integers(0, S, n - n_real)]).astype(np.int32)  # + padding
    outs = [store(poisoned(c, static), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots), c)
            for c in (flt, itg)]
    (lf, sf), (li, si) = outs
    assert li.k.dtype == pool_dtype(itg) and lf.k.dtype == jnp.dtype(storage)
    for a, b, name in ((lf.k, li.k, "K"), (lf.v, li.v, "V")):
        assert_same(as_storage(np.asarray(b), itg), a, f"{name} pages (host view)")
        assert_same(as_storage(b, itg), a, f"{name} pages")
    for a, b in ((lf.k_scale, li.k_scale), (lf.v_scale, li.v_scale)):
        assert_same(b, a, "scales")
    np.testing.assert_array_equal(np.asarray(sf), np.asarray(si))
    # The read path: the same values through either pool, NaN included (bit compare).
    tables = jnp.asarray(rng.permutation(np.arange(1, P))[None, :].repeat(3, 0), jnp.int32)
    for c, layer in ((flt, lf), (itg, li)):
        got = reference.gather_dequantized(layer.k, layer.k_scale, tables, c)
        want = reference.gather_dequantized(lf.k, lf.k_scale, tables, flt)
        assert_same(got, want, "gathered pages")
    q = jnp.asarray(rng.standard_normal((3, 2, 2 * H, D)), jnp.float32)
    lens = jnp.asarray([5, (P - 1) * S, 40], jnp.int32)
    pos = jnp.stack([lens - 2, lens - 1], axis=1)
    a = attend(q, lf, tables, lens, pos, flt, 0.125)
    b = attend(q, li, tables, lens, pos, itg, 0.125)
    assert_same(b, a, "attention")


def test_pallas_backends_refuse_integer_pools():
    from jfp8kv import kernels

    cfg = CacheConfig(1, H, D, P, S, "bfloat16", None, bitcast_pool=True)
    layer = KVCache.init(cfg).layer(0)
    x = jnp.zeros((2, H, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="bitcast_pool=False"):
        kernels.store_kv(layer, x, x, jnp.zeros(2, jnp.int32), cfg, "pallas_interpret")


def test_tensor_mode_refuses_per_channel_scales():
    """'tensor' holds one static scale per layer and head (kernels read channel 0): scales
    that vary along head_dim are refused with the mode that takes them."""
    cfg = CacheConfig(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=4, page_size=16,
                      storage_dtype="float8_e4m3fn", scale_mode="tensor")
    per_head = np.full((1, 2, 1), 0.01, np.float32)
    KVCache.init(cfg, per_head, per_head)
    per_channel = np.linspace(0.01, 0.02, 128, dtype=np.float32).reshape(1, 2, 64)
    with pytest.raises(ValueError, match="'channel'"):
        KVCache.init(cfg, per_channel, per_head)
