"""The fp8 policy (``jfp8kv.kvcache.fp8``) against ml_dtypes, bit for bit.

Oracle: ``ml_dtypes`` float32 -> fp8 casts (round-to-nearest-even), applied to the same
float32 value the policy casts, i.e. ``clip(x * (1/s), -fmax, fmax)``. For power-of-two
scales that equals ``x / s`` exactly. Bits are compared as uint8, all NaN encodings equal.

Every cast path is covered: ``saturating_cast`` on float32 / bfloat16 / float16 inputs,
``quantize`` with power-of-two and arbitrary scales, eager and jitted. Inputs: all 65,536
bf16 and fp16 bit patterns, and float32 points at and around every rounding tie of both
formats (midpoints of adjacent fp8 values, their float32 neighbours, the subnormal ties and
the saturation boundary). The store's paths are in ``test_store_reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jfp8kv.kvcache import fp8

FORMATS = ("float8_e4m3fn", "float8_e5m2")
ML = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
INF = np.float32(np.inf)
# Inputs deliberately hold inf/NaN/overflowing values: numpy's float warnings are expected.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


# ---------------------------------------------------------------------------- oracle helpers
def finite_fp8_values(name: str) -> np.ndarray:
    """All finite values of the format, sorted, as float32 (+0 and -0 collapse to one)."""
    v = np.arange(256, dtype=np.uint8).view(ML[name]).astype(np.float32)
    return np.unique(v[np.isfinite(v)])


def tie_points(name: str) -> np.ndarray:
    """float32 points at and around every rounding decision of the format.

    The grid is extended by one phantom step beyond +-fmax, so the midpoint between fmax and
    the first value the format lacks (464 for e4m3, 61440 for e5m2) is the saturation
    boundary. Midpoints of fp8 neighbours have <= 5 significant bits: exact in float32.
    """
    v = finite_fp8_values(name)
    top = v[-1] - v[-2]
    grid = np.concatenate([[v[0] - top], v, [v[-1] + top]]).astype(np.float64)
    mid = (grid[:-1] + grid[1:]) / 2
    assert np.all(mid.astype(np.float32) == mid)
    mid = mid.astype(np.float32)
    specials = np.array([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38], np.float32)
    return np.concatenate([v, mid, np.nextafter(mid, INF), np.nextafter(mid, -INF), specials])


def all_bits(dtype) -> np.ndarray:
    """All 65,536 values of a 16-bit float dtype (NaN patterns included)."""
    return np.arange(1 << 16, dtype=np.uint16).view(dtype)


def oracle(y32: np.ndarray, name: str) -> np.ndarray:
    """ml_dtypes of clip(y) — y is the float32 value the policy casts."""
    m = np.float32(fp8.FMAX[name])
    return np.clip(y32.astype(np.float32), -m, m).astype(ML[name])


def assert_same_fp8(got, want, what: str = ""):
    """uint8 bit equality; any NaN encoding equals any other NaN encoding."""
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    gn, wn = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    nan_bad = gn != wn
    bits_bad = (got.view(np.uint8) != want.view(np.uint8)) & ~gn & ~wn
    bad = np.flatnonzero(nan_bad | bits_bad)
    assert bad.size == 0, (
        f"{what}: {bad.size} mismatches, e.g. got {got.ravel()[bad[:5]]} "
        f"want {want.ravel()[bad[:5]]}"
    )


def _maybe_jit(fn, use_jit):
    return jax.jit(fn) if use_jit else fn


# ---------------------------------------------------------------------- raw astype, pinned
def test_raw_astype_e4m3_pinned():
    """Plain ``astype(float8_e4m3fn)``: no saturation, NaN beyond the rounding range.

    e4m3fn has no inf. RNE sends (448, 464] to 448 (464 is the tie with the missing 480,
    even mantissa wins) and everything above 464, +-inf included, to NaN. NB: the design
    note's "NaN from 480" is loose: it is NaN from just above 464.
    """
    up = float(np.nextafter(np.float32(464), INF))
    table = [(447.0, 448.0), (448.0, 448.0), (449.0, 448.0), (463.9, 448.0), (464.0, 448.0),
             (up, np.nan), (479.0, np.nan), (480.0, np.nan), (1e4, np.nan), (3e38, np.nan),
             (np.inf, np.nan), (np.nan, np.nan)]
    x = np.array([a for a, _ in table] + [-a for a, _ in table], np.float32)
    want = np.array([b for _, b in table] + [-b for _, b in table], np.float32)
    for use_jit in (False, True):
        got = np.asarray(_maybe_jit(lambda t: t.astype(jnp.float8_e4m3fn), use_jit)(x))
        np.testing.assert_array_equal(got.astype(np.float32), want)


def test_raw_astype_e5m2_pinned():
    """Plain ``astype(float8_e5m2)``: IEEE-like, overflow gives inf, not NaN.

    (57344, 61440) -> 57344; 61440 is the tie with 65536 (= 2^16, beyond the format) and
    RNE picks the even neighbour, which is the overflow: inf. +-inf stays +-inf.
    """
    dn = float(np.nextafter(np.float32(61440), -INF))
    table = [(57344.0, 57344.0), (60000.0, 57344.0), (dn, 57344.0), (61440.0, np.inf),
             (65504.0, np.inf), (1e5, np.inf), (3e38, np.inf), (np.inf, np.inf),
             (np.nan, np.nan), (480.0, 512.0), (464.0, 448.0)]
    x = np.array([a for a, _ in table] + [-a for a, _ in table], np.float32)
    want = np.array([b for _, b in table] + [-b for _, b in table], np.float32)
    for use_jit in (False, True):
        got = np.asarray(_maybe_jit(lambda t: t.astype(jnp.float8_e5m2), use_jit)(x))
        np.testing.assert_array_equal(got.astype(np.float32), want)


@pytest.mark.parametrize("name", FORMATS)
def test_raw_astype_matches_ml_dtypes_at_ties(name):
    """The raw cast itself is RNE like ml_dtypes (no double rounding) at every tie."""
    x = tie_points(name)
    assert_same_fp8(jax.jit(lambda t: t.astype(name))(x), x.astype(ML[name]), "raw astype")


# ------------------------------------------------------------------ the policy's saturation
@pytest.mark.parametrize("use_jit", [False, True])
def test_saturating_cast_and_quantize_specials(use_jit):
    big = np.array([np.inf, 1e4, 3e38, 464.5, 480.0, np.nan], np.float32)
    x = np.concatenate([big, -big])
    sat = _maybe_jit(lambda t: fp8.saturating_cast(t, jnp.float8_e4m3fn), use_jit)
    got = np.asarray(sat(x)).astype(np.float32)
    np.testing.assert_array_equal(got, [448] * 5 + [np.nan] + [-448] * 5 + [np.nan])

    big = np.array([np.inf, 1e5, 3e38, 61440.0, 65504.0, np.nan], np.float32)
    x = np.concatenate([big, -big])
    sat = _maybe_jit(lambda t: fp8.saturating_cast(t, jnp.float8_e5m2), use_jit)
    got = np.asarray(sat(x)).astype(np.float32)
    np.testing.assert_array_equal(got, [57344] * 5 + [np.nan] + [-57344] * 5 + [np.nan])

    for name, m in fp8.FMAX.items():
        q = _maybe_jit(lambda t, s: fp8.quantize(t, s, name), use_jit)
        x = np.array([np.inf, -np.inf, 10 * m, -10 * m, np.nan], np.float32)
        got = np.asarray(q(x, np.float32(2.0))).astype(np.float32)
        np.testing.assert_array_equal(got, [m, -m, m, -m, np.nan])


# ------------------------------------------------------------------- every cast path, bits
@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_saturating_cast_all_16bit_patterns(name, use_jit):
    """bf16 and fp16 inputs (all 65,536 patterns) upcast exactly and round once."""
    sat = _maybe_jit(lambda t: fp8.saturating_cast(t, name), use_jit)
    for src in (ml_dtypes.bfloat16, np.float16):
        x = all_bits(src)
        x32 = x.astype(np.float32)
        want = oracle(x32, name)
        assert_same_fp8(sat(x), want, f"saturating_cast({np.dtype(src).name})")
        assert_same_fp8(sat(x32), want, f"saturating_cast(f32 of {np.dtype(src).name})")
        # In range, the clip is a no-op and one direct ml_dtypes cast agrees (no double
        # rounding through another format).
        inside = np.abs(x32) <= fp8.FMAX[name]
        direct = x.astype(ML[name])
        assert_same_fp8(np.asarray(sat(x))[inside], direct[inside], "direct 16-bit cast")


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_saturating_cast_float32_ties(name, use_jit):
    x = tie_points(name)
    sat = _maybe_jit(lambda t: fp8.saturating_cast(t, name), use_jit)
    assert_same_fp8(sat(x), oracle(x, name), "saturating_cast(f32 ties)")


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_quantize_power_of_two_scales(name, use_jit):
    """x / s is exact for s = 2^k, so quantize(x, s) == ml_dtypes(clip(x / s))."""
    q = _maybe_jit(lambda t, s: fp8.quantize(t, s, name), use_jit)
    ties = tie_points(name)
    bf = all_bits(ml_dtypes.bfloat16).astype(np.float32)
    for k in (-7, 0, 5, 9):
        s = np.float32(2.0**k)
        for x in (ties * s, bf):
            assert_same_fp8(q(x, s), oracle(x / s, name), f"quantize(s=2^{k})")
    # Per-element power-of-two scales broadcast along the last axis, as channel scales do.
    rng = np.random.default_rng(0)
    s = (2.0 ** rng.integers(-8, 9, size=16)).astype(np.float32)
    x = np.resize(ties, (ties.size // 16 + 1) * 16).reshape(-1, 16) * s
    assert_same_fp8(q(x, s), oracle(x / s, name), "quantize(channel scales)")


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_quantize_arbitrary_scales_is_multiply_by_reciprocal(name, use_jit):
    """For any scale the cast value is x * fl(1/s): one correctly rounded reciprocal per
    scale, one multiply per element. Pinned so every backend (XLA on CPU/GPU, Triton) can
    reproduce it exactly; a broadcast divide is rewritten to this by XLA anyway."""
    rng = np.random.default_rng(1)
    q = _maybe_jit(lambda t, s: fp8.quantize(t, s, name), use_jit)
    s_row = rng.uniform(0.01, 100.0, size=(512, 1)).astype(np.float32)  # token-like
    x = (rng.standard_normal((512, 64)) * s_row * fp8.FMAX[name] / 3).astype(np.float32)
    inv = np.float32(1.0) / s_row
    assert_same_fp8(q(x, s_row), oracle(x * inv, name), "quantize(row scales)")
    # Around every tie: x * fl(1/s) lands on, or one float32 ulp beside, each tie.
    ties = tie_points(name)
    s = np.float32(0.3712)
    x = ties * s
    assert_same_fp8(q(x, s), oracle(x * (np.float32(1) / s), name), "quantize(ties, s=0.3712)")


# ------------------------------------------------------------------------- dynamic scales
def _binade(lo_exp: int) -> np.ndarray:
    """Every float32 in [2^lo_exp, 2^(lo_exp + 1)): 2^23 values."""
    base = np.uint32((lo_exp + 127) << 23)
    return (base + np.arange(1 << 23, dtype=np.uint32)).view(np.float32)


def test_reciprocal_is_correctly_rounded():
    """fp8.reciprocal == IEEE float32 1/s (numpy) bit for bit: every significand (one full
    binade; the exponent only shifts the result), the extreme binades of its exact range,
    and random bit patterns of either sign across it. Outside it: 1/0 = inf, 1/inf = 0."""
    f = jax.jit(fp8.reciprocal)
    one = np.float32(1)
    for e in (0, -126, 125):
        s = _binade(e)
        np.testing.assert_array_equal(np.asarray(f(s)).view(np.uint32), (one / s).view(np.uint32))
    rng = np.random.default_rng(3)
    bits = rng.integers(1 << 23, 253 << 23, 1 << 20, dtype=np.uint32)
    bits |= rng.integers(0, 2, bits.size, dtype=np.uint32) << 31
    s = bits.view(np.float32)
    np.testing.assert_array_equal(np.asarray(f(s)).view(np.uint32), (one / s).view(np.uint32))
    sp = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)
    np.testing.assert_array_equal(np.asarray(f(sp)), [np.inf, -np.inf, 0.0, -0.0, np.nan])


@pytest.mark.parametrize("name", FORMATS)
def test_dynamic_scale_float32_never_saturates_exhaustive(name):
    """For every float32 amax in a binade, amax * fl(1/s) <= fmax and s is tight."""
    m = np.float32(fp8.FMAX[name])
    f = jax.jit(lambda a: fp8.dynamic_scale(a, name, jnp.float32))
    for e in (0, 37, -40):
        a = _binade(e)
        s = np.asarray(f(a))
        assert s.dtype == np.float32
        y = a * (np.float32(1) / s)
        assert np.all(y <= m), f"binade 2^{e}: {np.sum(y > m)} rows saturate"
        exact = np.maximum(a.astype(np.float64) / float(m), np.float32(fp8.SCALE_FLOOR))
        assert np.all(s >= exact * (1 - 2.0**-24))
        assert np.all(s <= exact * (1 + 2.0**-22))  # at most two float32 ulps above


@pytest.mark.parametrize("name", FORMATS)
def test_dynamic_scale_float16_never_saturates_and_is_tight(name):
    """fp16 block scales are rounded up, never down; exhaustive over two binades + random."""
    m = np.float32(fp8.FMAX[name])
    f = jax.jit(lambda a: fp8.dynamic_scale(a, name, jnp.float16))
    rng = np.random.default_rng(2)
    lo, hi = np.log2(2.0**-24 * float(m)), np.log2(65504.0 * float(m))
    rand = (2.0 ** rng.uniform(lo, hi, 1 << 20)).astype(np.float32)
    for a in (_binade(8), _binade(-12), rand):
        s = np.asarray(f(a))
        assert s.dtype == np.float16 and np.all(np.isfinite(s))
        s32 = s.astype(np.float32)
        y = a * (np.float32(1) / s32)
        assert np.all(y <= m), f"{np.sum(y > m)} rows saturate"
        exact = np.maximum(a.astype(np.float64) / float(m), 2.0**-24)
        assert np.all(s32 >= exact * (1 - 2.0**-24))
        # At most two fp16 steps above exact (round-up plus the reciprocal guard).
        step = np.maximum(2.0 ** (np.floor(np.log2(exact)) - 10), 2.0**-24)
        assert np.all(s32 - exact <= 2 * step)


@pytest.mark.parametrize("name", FORMATS)
def test_dynamic_scale_edge_rows(name):
    """Zero rows get the floor (no 0/0); NaN/inf rows get 1.0 (the NaN lives in the data);
    fp16 scales never overflow to inf: they cap at 65504 and the row saturates."""
    m = fp8.FMAX[name]
    a = np.array([0.0, 1e-30, np.nan, np.inf, 1e30, 3.4e38], np.float32)
    s32 = np.asarray(fp8.dynamic_scale(jnp.asarray(a), name, jnp.float32))
    np.testing.assert_array_equal(s32[:4], np.float32([fp8.SCALE_FLOOR, fp8.SCALE_FLOOR, 1, 1]))
    assert np.all(a[4:] * (np.float32(1) / s32[4:]) <= m)
    s16 = np.asarray(fp8.dynamic_scale(jnp.asarray(a), name, jnp.float16))
    np.testing.assert_array_equal(
        s16.astype(np.float32), np.float32([2.0**-24, 2.0**-24, 1, 1, 65504, 65504]))


@pytest.mark.parametrize("name", FORMATS)
def test_saturation_count_matches_clip(name):
    """Counted = finite elements the clip changes (their RNE rounds past fmax); values a
    hair above fmax round to it anyway and are not counted; NaN and +-inf are not counted."""
    m = fp8.FMAX[name]
    lim = fp8.SATURATES_ABOVE[name]
    s = np.float32(0.5)
    x = np.array([m / 2, m / 2 * 1.0001, -m, np.inf, -np.inf, np.nan, 0.0, 1e30, lim / 2,
                  np.nextafter(np.float32(lim), np.float32(np.inf)) / 2], np.float32)
    assert float(fp8.saturation_count(x, s, name)) == 3.0  # -m, 1e30, just past the limit
    # the limit is where ml_dtypes' unclipped RNE cast first leaves the format (NaN or inf)
    dt = getattr(ml_dtypes, name)
    assert np.float32(lim).astype(dt).astype(np.float32) == m
    assert not np.isfinite(np.nextafter(np.float32(lim), np.float32(np.inf)).astype(dt)
                           .astype(np.float32))
