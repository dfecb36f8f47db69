"""The reference store (``jfp8kv.kernels.reference.store_kv``): bytes, scales, telemetry and
round-trip error, for every storage format and scale mode.

Stored bytes are compared with ml_dtypes, bit for bit (uint8 views, NaN == NaN), applied to
``clip(x * fl(1/s))`` with the scale the pool holds; dynamic scales are compared with the
policy (``fp8.dynamic_scale``, itself tested in ``test_fp8.py``) on amax computed here.
Pages and dynamic scales are poisoned with NaN before every store: a slot the store does
not write stays NaN, and a slot it should write cannot pass by accident.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jfp8kv.config import CacheConfig
from jfp8kv.kernels import reference
from jfp8kv.kvcache import fp8
from jfp8kv.kvcache.cache import STAT_FIELDS, KVCache, accumulate_stats, reduce_stat_rows

FORMATS = ("float8_e4m3fn", "float8_e5m2")
MODES = ("tensor", "channel", "token", "block")
ML = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
MANT = {"float8_e4m3fn": 3, "float8_e5m2": 2}  # explicit mantissa bits
EMIN = {"float8_e4m3fn": -6, "float8_e5m2": -14}  # exponent of the smallest normal
H, D, S, P = 2, 64, 16, 33  # heads, head_dim, page_size, pages (page 0 = padding sink)

store = jax.jit(reference.store_kv, static_argnums=4)
gather = jax.jit(reference.gather_dequantized, static_argnums=3)
# Inputs deliberately hold inf/NaN/overflowing values: numpy's float warnings are expected.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def make_cfg(storage: str, mode: str | None, head_dim: int = D) -> CacheConfig:
    return CacheConfig(num_layers=1, num_kv_heads=H, head_dim=head_dim, num_pages=P,
                       page_size=S, storage_dtype=storage,
                       scale_mode=mode if storage.startswith("float8") else None)


def poisoned_layer(cfg: CacheConfig, k_scale=None, v_scale=None):
    """Layer 0 of a fresh pool, pages (and dynamic scales) filled with NaN."""
    layer = KVCache.init(cfg, k_scale, v_scale).layer(0)
    nan_like = lambda a: jnp.full(a.shape, jnp.nan, a.dtype)  # noqa: E731
    layer.k, layer.v = nan_like(layer.k), nan_like(layer.v)
    if cfg.scale_mode in ("token", "block"):
        layer.k_scale, layer.v_scale = nan_like(layer.k_scale), nan_like(layer.v_scale)
    return layer


def random_slots(rng, n: int, num_pages: int = P) -> np.ndarray:
    """n distinct flat slots outside the sink page."""
    return (rng.permutation((num_pages - 1) * S)[:n] + S).astype(np.int32)


def rows_at(pages, slots) -> np.ndarray:
    """[H, P, S, ...] pool array -> [N, H, ...] rows at the given flat slots."""
    a = np.asarray(pages)
    return np.moveaxis(a.reshape(a.shape[0], -1, *a.shape[3:])[:, slots], 0, 1)


def assert_same_fp8(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    gn, wn = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    bad = (gn != wn) | ((got.view(np.uint8) != want.view(np.uint8)) & ~gn & ~wn)
    idx = np.flatnonzero(bad)
    assert idx.size == 0, (f"{what}: {idx.size} mismatches, e.g. got "
                           f"{got.ravel()[idx[:5]]} want {want.ravel()[idx[:5]]}")


def expected_rows(x32, scale, cfg):
    """Oracle bytes for rows x32 [N, H, D] given the scales the pool holds for them."""
    name = cfg.storage_dtype
    m = np.float32(fp8.FMAX[name])
    one = np.float32(1)
    if cfg.scale_mode in ("tensor", "channel"):
        y = x32 * (one / scale)[None]  # scale [H, D]
    elif cfg.scale_mode == "token":
        y = x32 * (one / scale)[..., None]  # scale [N, H]
    else:  # block: scale [N, H, nb] fp16
        xb = x32.reshape(*x32.shape[:2], -1, cfg.scale_block)
        y = (xb * (one / scale.astype(np.float32))[..., None]).reshape(x32.shape)
    with np.errstate(invalid="ignore"):
        return np.clip(y, -m, m).astype(ML[name])


def policy_scales(x32, cfg):
    """Dynamic scales the policy gives for rows x32 [N, H, D]; amax computed in numpy over
    the non-NaN elements (a NaN element must not change its row's scale)."""
    name = cfg.storage_dtype
    ax = np.abs(x32)
    ax[np.isnan(ax)] = 0
    if cfg.scale_mode == "token":
        return np.asarray(fp8.dynamic_scale(jnp.asarray(ax.max(-1)), name))
    xb = ax.reshape(*x32.shape[:2], -1, cfg.scale_block)
    return np.asarray(fp8.dynamic_scale(jnp.asarray(xb.max(-1)), name, jnp.float16))


def static_scales(rng, mode):
    """Power-of-two static scales [H, D] (tensor: one value)."""
    if mode == "tensor":
        return np.full((H, D), 2.0**-3, np.float32)
    return (2.0 ** rng.integers(-6, 7, size=(H, D))).astype(np.float32)


def store_and_check_bits(cfg, k, v, rng, k_scale=None, v_scale=None):
    """Store rows k, v [N, H, D] at random slots; check bytes and scales; return stats."""
    slots = random_slots(rng, k.shape[0])
    layer = poisoned_layer(cfg, k_scale, v_scale)
    out, stats = store(layer, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots), cfg)
    for x, pages, sc, name in ((k, out.k, out.k_scale, "K"), (v, out.v, out.v_scale, "V")):
        x32 = np.asarray(x).astype(np.float32)
        if cfg.scale_mode in ("token", "block"):
            held = rows_at(sc, slots)
            want_s = policy_scales(x32, cfg)
            np.testing.assert_array_equal(held, want_s, err_msg=f"{name} dynamic scales")
        else:
            held = np.asarray(sc)
        assert_same_fp8(rows_at(pages, slots), expected_rows(x32, held, cfg), f"{name} bytes")
        # Nothing else was touched: every other slot is still poison.
        rest = np.setdiff1d(np.arange(S, P * S), slots)
        assert np.all(np.isnan(rows_at(pages, rest).astype(np.float32))), f"{name} stray write"
    return np.asarray(stats)


# ------------------------------------------------------------------------ bits, all paths
def bf16_rows(rng, finite_only: bool) -> np.ndarray:
    """All 65,536 bf16 patterns as [512, H, D] rows.

    ``finite_only``: NaN/inf dropped (refilled with zeros), values sorted by magnitude, then
    shuffled within windows of 2,048, so each row spans <= 8 binades and its own scale
    exercises most of the fp8 grid; otherwise a plain shuffle, NaN and inf included.
    """
    x = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    if finite_only:
        x = x[np.isfinite(x.astype(np.float32))]
        x = x[np.argsort(np.abs(x.astype(np.float32)), kind="stable")]
        x = np.concatenate([x, np.zeros(65536 - x.size, x.dtype)])
        x = rng.permuted(x.reshape(-1, 2048), axis=1)
    return rng.permutation(x.reshape(-1, H * D), axis=0).reshape(-1, H, D) if finite_only \
        else rng.permutation(x).reshape(-1, H, D)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("finite_only", [True, False])
def test_store_bits_all_bf16_patterns(name, mode, finite_only):
    rng = np.random.default_rng(10)
    cfg = make_cfg(name, mode)
    x = bf16_rows(rng, finite_only)  # [512, H, D] bf16
    n = x.shape[0] // 2
    k, v = x[:n], x[n:]
    ks = vs = None
    if mode in ("tensor", "channel"):
        ks, vs = static_scales(rng, mode), static_scales(rng, mode)
    stats = store_and_check_bits(cfg, k, v, rng, ks, vs)
    assert np.all(np.isfinite(stats[:4]))


def _tie_points(name):
    v = np.arange(256, dtype=np.uint8).view(ML[name]).astype(np.float32)
    v = np.unique(v[np.isfinite(v)])
    top = v[-1] - v[-2]
    g = np.concatenate([[v[0] - top], v, [v[-1] + top]]).astype(np.float64)
    mid = ((g[:-1] + g[1:]) / 2).astype(np.float32)
    inf = np.float32(np.inf)
    return np.concatenate([v, mid, np.nextafter(mid, inf), np.nextafter(mid, -inf)])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_store_bits_at_rounding_ties(name, mode):
    """Every tie of the format (and its float32 neighbours) lands exactly on the cast.

    Static modes: y = tie * 2^k per channel, saturation boundary included. Dynamic modes:
    each 32-wide block starts with an anchor fmax * 2^k, so the row/block scale is exactly
    2^k and the other 31 elements are in-range ties * 2^k.
    """
    rng = np.random.default_rng(11)
    cfg = make_cfg(name, mode)
    m = fp8.FMAX[name]
    ties = _tie_points(name)
    if mode in ("tensor", "channel"):
        ks, vs = static_scales(rng, mode), static_scales(rng, mode)
        n = -(-ties.size // (H * D))
        y = np.resize(rng.permutation(ties), (2, n, H, D))
        store_and_check_bits(cfg, y[0] * ks, y[1] * vs, rng, ks, vs)
        return
    inner = ties[np.abs(ties) <= m]
    nb = D // 32
    n = -(-inner.size // (H * nb * 31))
    body = np.resize(rng.permutation(inner), (2, n, H, nb, 31))
    anchor = np.full((2, n, H, nb, 1), m, np.float32) * rng.choice([-1, 1], (2, n, H, nb, 1))
    k_exp = rng.integers(-20, 15, size=(2, n, 1, 1, 1))
    x = (np.concatenate([anchor, body], -1) * 2.0**k_exp).astype(np.float32).reshape(2, n, H, D)
    slots = random_slots(rng, n)
    out, stats = store(poisoned_layer(cfg), jnp.asarray(x[0]), jnp.asarray(x[1]),
                       jnp.asarray(slots), cfg)
    for i, (pages, sc) in enumerate(((out.k, out.k_scale), (out.v, out.v_scale))):
        held = rows_at(sc, slots).astype(np.float32)  # token [n, H], block [n, H, nb]
        want_s = np.broadcast_to((2.0 ** k_exp[i]).reshape(n, 1, 1), (n, H, nb))
        np.testing.assert_array_equal(held, want_s if mode == "block" else want_s[..., 0])
        assert_same_fp8(rows_at(pages, slots), expected_rows(x[i], rows_at(sc, slots), cfg))
    np.testing.assert_array_equal(np.asarray(stats)[:4], 0)


@pytest.mark.parametrize("mode", MODES)
def test_store_non_fp8_passthrough_and_fp8_bf16_input(mode):
    """bf16 storage keeps bf16 inputs exactly; fp8 storage of bf16 == fp8 storage of f32."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 40, H, D)).astype(ml_dtypes.bfloat16)
    slots = random_slots(rng, 40)
    cfg = make_cfg("bfloat16", None)
    out, stats = store(poisoned_layer(cfg), jnp.asarray(x[0]), jnp.asarray(x[1]),
                       jnp.asarray(slots), cfg)
    np.testing.assert_array_equal(rows_at(out.k, slots).view(np.uint16), x[0].view(np.uint16))
    np.testing.assert_array_equal(np.asarray(stats)[:4], 0)
    cfg = make_cfg("float8_e4m3fn", mode)
    sc = static_scales(rng, mode) if mode in ("tensor", "channel") else None
    a, _ = store(poisoned_layer(cfg, sc, sc), jnp.asarray(x[0]), jnp.asarray(x[1]),
                 jnp.asarray(slots), cfg)
    b, _ = store(poisoned_layer(cfg, sc, sc), jnp.asarray(x[0].astype(np.float32)),
                 jnp.asarray(x[1].astype(np.float32)), jnp.asarray(slots), cfg)
    assert_same_fp8(rows_at(a.k, slots), rows_at(b.k, slots), "bf16 vs f32 input")
    assert_same_fp8(rows_at(a.v, slots), rows_at(b.v, slots), "bf16 vs f32 input")


# --------------------------------------------------------------------------- telemetry
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_stats_nan_saturation_padding_amax(name, mode):
    """NaN stays NaN and is counted; saturated finite values are counted (static modes);
    padding lanes (slot in page 0) count for nothing, whatever they hold; amax is over real
    tokens, NaN ignored, inf included."""
    rng = np.random.default_rng(13)
    cfg = make_cfg(name, mode)
    m = fp8.FMAX[name]
    n_real, n_pad = 48, 16
    k = rng.standard_normal((n_real + n_pad, H, D)).astype(np.float32)
    v = rng.standard_normal((n_real + n_pad, H, D)).astype(np.float32)
    sc = np.full((H, D), 0.01, np.float32) if mode in ("tensor", "channel") else None
    # Real tokens: a few NaNs, an inf in K, and values far beyond fmax * scale.
    k[3, 0, 5] = k[7, 1, 60] = np.nan
    v[9, 1, 2] = np.nan
    k[11, 0, 0] = np.inf
    k[20, 1, 3] = -50 * m
    v[21, 0, 7] = 3 * m
    # Padding lanes: poison that must not be counted (NaN, huge, inf).
    k[n_real:] = np.nan
    v[n_real:, 0] = 1e30
    v[n_real:, 1] = -np.inf
    slots = np.concatenate([random_slots(rng, n_real), rng.integers(0, S, n_pad)]).astype(np.int32)
    layer = poisoned_layer(cfg, sc, sc)
    out, stats = store(layer, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots), cfg)
    stats = dict(zip(STAT_FIELDS, np.asarray(stats).tolist()))
    kr, vr = k[:n_real], v[:n_real]
    assert stats["k_nan"] == 2 and stats["v_nan"] == 1
    if mode in ("tensor", "channel"):
        with np.errstate(invalid="ignore"):
            lim = fp8.SATURATES_ABOVE[name]
            want_k = np.sum(np.isfinite(kr) & (np.abs(kr) * np.float32(100) > lim))
            want_v = np.sum(np.isfinite(vr) & (np.abs(vr) * np.float32(100) > lim))
        assert (stats["k_saturated"], stats["v_saturated"]) == (want_k, want_v)
        assert want_k >= 1 and want_v >= 1  # at least the planted ones
    else:  # dynamic: no finite value saturates (the inf row/block gets scale 1.0, and its
        # other values are far below fmax)
        assert stats["k_saturated"] == 0 and stats["v_saturated"] == 0
    assert stats["k_amax"] == np.inf
    assert stats["v_amax"] == np.float32(np.nanmax(np.abs(vr)))
    # NaN inputs are NaN in the pool, at their places; +-inf saturates to +-fmax * scale.
    kq = rows_at(out.k, slots[:n_real]).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(kq), np.isnan(kr))
    assert kq[11, 0, 0] == m
    # Padding lanes only ever wrote into page 0.
    real_pages = np.setdiff1d(np.arange(S, P * S), slots[:n_real])
    assert np.all(np.isnan(rows_at(out.k, real_pages).astype(np.float32)))


@pytest.mark.parametrize("mode", ["token", "block"])
@pytest.mark.parametrize("name", FORMATS)
def test_all_zero_rows_store_zeros(name, mode):
    rng = np.random.default_rng(14)
    cfg = make_cfg(name, mode)
    k = np.zeros((8, H, D), np.float32)
    k[1] = -0.0
    v = k.copy()
    v[5, 1, 33] = 1.0  # one non-zero block in an otherwise zero row
    slots = random_slots(rng, 8)
    out, stats = store(poisoned_layer(cfg), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                       cfg)
    for pages, sc, x in ((out.k, out.k_scale, k), (out.v, out.v_scale, v)):
        q = rows_at(pages, slots).astype(np.float32)
        assert np.all(np.isfinite(q))
        np.testing.assert_array_equal(q[x == 0], 0.0)
        held = rows_at(sc, slots).astype(np.float32)
        floor = np.float32(fp8.SCALE_FLOOR if mode == "token" else fp8.SCALE_FLOOR_F16)
        assert np.all(np.isfinite(held)) and np.min(held) == floor
    np.testing.assert_array_equal(np.asarray(stats), [0, 0, 0, 0, 0, 1])


@pytest.mark.parametrize("mode", ["token", "block"])
@pytest.mark.parametrize("name", FORMATS)
def test_dynamic_modes_never_saturate_finite_rows(name, mode):
    """Finite rows of any magnitude: no saturation counted, nothing NaN on read-back.

    Pinned limit: fp16 block scales cap at 65504, so a block whose amax exceeds
    65504 x fmax (2.9e7 for e4m3, 3.8e9 for e5m2) saturates -- counted, and read back
    as +-65504 x fmax, never NaN. Token scales are float32: no finite row saturates.
    """
    rng = np.random.default_rng(15)
    cfg = make_cfg(name, mode)
    m = fp8.FMAX[name]
    mags = np.array([1e-30, 1e-12, 1e-6, 1.0, 1e3, 1e7, 1e20, 1e30, 3e38], np.float32)
    n = 64
    k = rng.standard_normal((n, H, D)).astype(np.float32)
    k *= rng.choice(mags, size=(n, 1, 1)).astype(np.float32) / np.abs(k).max((1, 2), keepdims=True)
    v = rng.standard_normal((n, H, D)).astype(np.float32) * np.float32(1e4)
    slots = random_slots(rng, n)
    out, stats = store(poisoned_layer(cfg), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                       cfg)
    stats = np.asarray(stats)
    page_tables = jnp.asarray(np.arange(1, P, dtype=np.int32)[None])
    back = np.asarray(gather(out.k, out.k_scale, page_tables, cfg))
    held = back[0].transpose(1, 0, 2)[slots - S]  # [N, H, D] in slot order
    assert np.all(np.isfinite(held)), "finite input read back as NaN/inf"
    cap = 65504.0 * m
    if mode == "token":
        assert stats[0] == 0 and stats[1] == 0
    else:
        assert stats[1] == 0
        assert stats[0] == np.sum(np.abs(k) * (np.float32(1) / np.float32(65504)) > m)
        big = np.abs(k) > cap * 1.001
        assert big.any()
        np.testing.assert_array_equal(held[big], np.sign(k[big]) * np.float32(cap))


# ---------------------------------------------------------------------- round-trip bound
def _roundtrip_bound(x, s, name):
    """|dequant(quant(x)) - x| bound, float64. With u = 2^-24 (float32 rounding):

    y = x*fl(1/s) = (x/s)(1+e1)(1+e2); q = y + d, |d| <= 2^-(m+1) max(|y|, 2^emin);
    x' = fl(q*s) = q*s(1+e3); so |x' - x| <= 2^-(m+1) max(|x|, 2^emin s)(1+u)^3
    + ((1+u)^3 - 1)|x|, for |y| <= fmax (no saturation). Relative 2^-(m+1) for normal-range
    values, absolute 2^-(m+1) * 2^emin * s below.
    """
    half_ulp = 2.0 ** -(MANT[name] + 1)
    return half_ulp * np.maximum(np.abs(x), 2.0 ** EMIN[name] * s) * (1 + 2.0**-21) \
        + 2.0**-22 * np.abs(x)


def _data(rng, kind, n, d):
    if kind == "normal":
        return rng.standard_normal((n, H, d))
    # Heavy tails: Student-t(1.5), per-channel magnitudes over 2^-6..2^6 (K-like), sparse
    # outliers x1000, and some rows a million times smaller than the rest.
    x = rng.standard_t(1.5, (n, H, d)) * 2.0 ** rng.integers(-6, 7, (1, H, d))
    x *= np.where(rng.random((n, H, d)) < 1e-3, 1e3, 1.0)
    return x * np.where(rng.random((n, 1, 1)) < 0.1, 1e-6, 1.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_roundtrip_error_within_format_bound(name, mode):
    """Store then ``gather_dequantized`` through shuffled page tables: every element within
    the bound above, and the bound is attained (max relative error > 0.85 half-ulp).

    K holds normal data, V heavy-tailed data. Static scales are the appropriate ones:
    amax / fmax (per tensor, or per head and channel), a hair above so nothing saturates.
    """
    rng = np.random.default_rng(16)
    cfg = make_cfg(name, mode, head_dim=128)
    d = cfg.head_dim
    b, mp = 4, (P - 1) // 4
    tables = rng.permutation(np.arange(1, P, dtype=np.int32)).reshape(b, mp)
    t = np.arange(mp * S)
    slots = (tables[:, t // S] * S + t % S).reshape(-1)  # [B * L] in (b, position) order
    n = slots.size
    x = np.stack([_data(rng, kind, n, d) for kind in ("normal", "heavy")]).astype(np.float32)
    m = fp8.FMAX[name]
    sc = [None, None]
    for i in range(2):
        if mode == "tensor":
            sc[i] = np.full((H, d), np.abs(x[i]).max() / m * (1 + 2.0**-20), np.float32)
        elif mode == "channel":
            sc[i] = (np.abs(x[i]).max(0) / m * (1 + 2.0**-20)).astype(np.float32)
    out, stats = store(poisoned_layer(cfg, *sc), jnp.asarray(x[0]), jnp.asarray(x[1]),
                       jnp.asarray(slots), cfg)
    np.testing.assert_array_equal(np.asarray(stats)[:4], 0)
    for i, (pages, scale) in enumerate(((out.k, out.k_scale), (out.v, out.v_scale))):
        back = np.asarray(gather(pages, scale, jnp.asarray(tables), cfg))
        back = back.transpose(0, 2, 1, 3).reshape(n, H, d)  # [B, H, L, D] -> [N, H, D]
        assert np.all(np.isfinite(back))
        if mode in ("tensor", "channel"):
            s = np.broadcast_to(sc[i], x[i].shape)
        elif mode == "token":
            s = np.broadcast_to(rows_at(scale, slots)[..., None], x[i].shape)
        else:
            s = np.repeat(rows_at(scale, slots).astype(np.float32), cfg.scale_block, axis=-1)
        err = np.abs(back.astype(np.float64) - x[i])
        bound = _roundtrip_bound(x[i].astype(np.float64), s.astype(np.float64), name)
        excess = err > bound
        assert not excess.any(), (f"{excess.sum()} elements over the bound, e.g. x="
                                  f"{x[i][excess][:3]} back={back[excess][:3]}")
        normal = np.abs(x[i]) >= 2.0 ** EMIN[name] * s * 2
        worst = float(np.max(err[normal] / np.abs(x[i][normal])))
        assert worst > 0.85 * 2.0 ** -(MANT[name] + 1), worst


def test_stat_rows_reduce_and_accumulate():
    """Per-program partial stats rows -> one row per layer (counts summed, amax maximized),
    then the running per-layer stats (counts add, amax keeps its maximum)."""
    rng = np.random.default_rng()
    rows = np.concatenate([rng.integers(0, 50, (3, 5, 4)), rng.uniform(0, 9, (3, 5, 2))],
                          -1).astype(np.float32)  # 3 layers x 5 programs
    got = np.asarray(reduce_stat_rows(jnp.asarray(rows)))
    np.testing.assert_array_equal(got[:, :4], rows[..., :4].sum(1))
    np.testing.assert_array_equal(got[:, 4:], rows[..., 4:].max(1))
    old = np.asarray([[1, 2, 3, 4, 5.0, 0.5]] * 3, np.float32)
    acc = np.asarray(accumulate_stats(jnp.asarray(old), jnp.asarray(got)))
    np.testing.assert_array_equal(acc[:, :4], old[:, :4] + got[:, :4])
    np.testing.assert_array_equal(acc[:, 4:], np.maximum(old[:, 4:], got[:, 4:]))
