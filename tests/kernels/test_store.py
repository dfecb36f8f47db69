"""Pallas fused quantize-and-store vs the reference store: bit-exact bytes, scales and stats.

Pages and dynamic scales are NaN-poisoned before the store, so a slot the kernel should
not touch must still be NaN afterwards and a slot it should write cannot pass by accident.
Inputs mix magnitudes (1e-3..1e3 per row), exact zeros rows, and NaN / inf / huge
elements; padding lanes (slots in page 0, repeated) and a token count that is not a
multiple of the kernel's block are included. The kernel's own fp32 -> fp8 encoder is
checked against ml_dtypes over every bf16 bit pattern and the float32 tie points.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jfp8kv.kernels import pallas_store, reference
from jfp8kv.kvcache import fp8
from jfp8kv.kvcache.cache import KVCache

from .cases import has_gpu, make_cfg, on_cpu, on_exec, poisoned_store_case, sweep

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
ML = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
ref_store = jax.jit(reference.store_kv, static_argnums=4)


def _encode_vs_ml_dtypes(y: np.ndarray, name: str):
    m = fp8.FMAX[name]
    yc = np.where(np.isnan(y), y, np.clip(y, -m, m)).astype(np.float32)
    got = np.asarray(jax.jit(fp8.fp8_bits, static_argnums=1)(yc, name))
    want = yc.astype(ML[name]).view(np.uint8).astype(np.int32)
    nan = np.isnan(yc)
    assert (got[~nan] == want[~nan]).all(), yc[~nan][got[~nan] != want[~nan]][:8]
    assert ((got[nan] & 0x7F) == {"float8_e4m3fn": 0x7F, "float8_e5m2": 0x7E}[name]).all()


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_encoder_all_bf16_patterns(name):
    y = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
    _encode_vs_ml_dtypes(y.astype(np.float32), name)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_encoder_f32_ties_and_neighbours(name):
    # Every fp8 value v and its successor: the midpoint and one f32 ulp either side of it.
    codes = np.arange(256, dtype=np.uint8).view(ML[name]).astype(np.float32)
    codes = np.unique(codes[np.isfinite(codes) & (codes >= 0)])
    mids = ((codes[:-1].astype(np.float64) + codes[1:]) / 2).astype(np.float32)
    ys = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), codes,
                         np.float32([1e-30, 1e-45, 0.0, np.nan, np.inf])])
    _encode_vs_ml_dtypes(np.concatenate([ys, -ys]), name)


CASES = [  # (storage, mode, page_size, head_dim, kv_heads, new tokens, block_n)
    ("bfloat16", None, 16, 64, 2, 45, 16),
    ("float8_e4m3fn", "tensor", 8, 64, 2, 45, 32),
    ("float8_e4m3fn", "token", 16, 128, 2, 45, 16),
    ("float8_e4m3fn", "block", 8, 64, 3, 37, 16),
    ("float8_e5m2", "token", 32, 64, 2, 45, 32),
    ("float8_e5m2", "channel", 16, 64, 1, 20, 16),
    # GPU only:
    ("float16", None, 8, 128, 2, 45, 32),
    ("float32", None, 16, 64, 2, 45, 16),
    ("float8_e5m2", "block", 16, 128, 8, 300, 32),
    ("float8_e4m3fn", "token", 16, 128, 8, 1000, 64),
    ("float8_e4m3fn", "channel", 64, 256, 2, 100, 32),
    ("float8_e4m3fn", "tensor", 128, 128, 4, 513, 32),
]
IDS = [f"{c[0]}-{c[1]}-S{c[2]}-D{c[3]}-Hkv{c[4]}-N{c[5]}-bn{c[6]}" for c in CASES]


def _rows(rng, n, h, d):
    x = rng.standard_normal((n, h, d)).astype(np.float32)
    x *= 10.0 ** rng.integers(-3, 4, (n, h, 1))  # per-row magnitudes 1e-3 .. 1e3
    x[rng.integers(n), rng.integers(h)] = 0.0  # an all-zero row
    for val in (np.nan, np.inf, -np.inf, 1e30):
        x[rng.integers(n), rng.integers(h), rng.integers(d)] = val
    return x


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=range(6)))
def test_store_matches_reference_bit_exact(case, exec_mode):
    storage, mode, s, d, hkv, n, bn = case
    rng = np.random.default_rng()
    cfg, layer, slots = poisoned_store_case(rng, storage, mode, heads_kv=hkv, head_dim=d,
                                            page_size=s, new_tokens=n)
    pad = rng.choice(n, size=min(3, n), replace=False)
    slots[pad] = rng.integers(0, s, size=pad.size)  # padding lanes into the sink page
    slots[pad[0]] = slots[pad[-1]]  # two padding lanes on one slot
    k = jnp.asarray(_rows(rng, n, hkv, d), jnp.bfloat16)
    v = jnp.asarray(_rows(rng, n, hkv, d), jnp.bfloat16)
    want_layer, want_stats = on_cpu(ref_store, layer, k, v, jnp.asarray(slots), cfg)
    got_layer, got_stats = on_exec(exec_mode, pallas_store.store_kv, layer, k, v,
                                   jnp.asarray(slots), cfg, block_n=bn)
    for field in ("k", "v", "k_scale", "v_scale"):
        got, want = np.asarray(getattr(got_layer, field)), np.asarray(getattr(want_layer, field))
        assert got.shape == want.shape and got.dtype == want.dtype, field
        gnan = np.isnan(got.astype(np.float32))
        wnan = np.isnan(want.astype(np.float32))
        assert (gnan == wnan).all(), f"{field}: NaN positions differ ({(gnan != wnan).sum()})"
        diff = (_bits(got) != _bits(want)) & ~wnan
        assert not diff.any(), f"{field}: {diff.sum()} elements differ, first at {np.argwhere(diff)[:3]}"
    np.testing.assert_array_equal(np.asarray(got_stats), np.asarray(want_stats))


# ---- the fp32 -> fp8 cast through the store kernel, per cast path (fp8.KERNEL_CASTS) ----

def _cast_inputs(name: str) -> np.ndarray:
    """Every bf16 bit pattern, then the f32 tie points of ``name`` (midpoints of adjacent fp8
    values and one f32 ulp either side, both signs), +-inf, NaN, beyond-fmax values."""
    bf = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
    codes = np.arange(256, dtype=np.uint8).view(ML[name]).astype(np.float32)
    codes = np.unique(codes[np.isfinite(codes) & (codes >= 0)])
    mids = ((codes[:-1].astype(np.float64) + codes[1:]) / 2).astype(np.float32)
    m = fp8.FMAX[name]
    over = np.float32([m * 1.03, m * 1.0625, m * 1.07, m * 1.5, 1e30, np.finfo(np.float32).max])
    ties = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), codes,
                           over, np.float32([1e-30, 1e-45, np.inf, np.nan])])
    return np.concatenate([bf.astype(np.float32), ties, -ties])


def _store_cast(values: np.ndarray, name: str, exec_mode: str, fp8_cast: str):
    """Store ``values`` as K (and -values as V) rows through the kernel in tensor mode with
    scale 1.0 (so the value cast is the input itself); return the stored K and V bytes."""
    d = 128
    n = -(-values.size // d)
    x = np.zeros(n * d, np.float32)
    x[:values.size] = values
    s = 16
    cfg = make_cfg(name, "tensor", heads_kv=1, head_dim=d, page_size=s, num_pages=2 + -(-n // s))
    one = np.ones((1, d), np.float32)
    layer = KVCache.init(cfg, one, one).layer(0)
    k = jnp.asarray(x.reshape(n, 1, d))
    slots = jnp.arange(s, s + n, dtype=jnp.int32)
    got, _ = on_exec(exec_mode, pallas_store.store_kv, layer, k, -k, slots, cfg,
                     fp8_cast=fp8_cast)
    rows = lambda a: np.asarray(a).reshape(-1, d)[s:s + n].reshape(-1)[:values.size]  # noqa: E731
    return _bits(rows(got.k)), _bits(rows(got.v))


@pytest.mark.parametrize("fp8_cast,exec_mode", [
    ("software", "interpret"), ("hardware", "interpret"),
    *[pytest.param(c, "gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not has_gpu(), reason="needs an NVIDIA GPU")]) for c in ("software", "hardware",
                                                                 "satfinite")]])
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_store_cast_exhaustive(name, fp8_cast, exec_mode):
    """The store's fp32 -> fp8 cast equals ml_dtypes on clip(x) for every bf16 pattern and
    every f32 tie point, through the actual kernel: on the GPU for each cast path (the
    hardware ones are what the policy picks from sm_90), in interpret mode for the software
    path and the portable hardware one (XLA's cast standing in for ``cvt``)."""
    x = _cast_inputs(name)
    m = fp8.FMAX[name]
    for got, vals in zip(_store_cast(x, name, exec_mode, fp8_cast), (x, -x)):
        want = np.clip(vals, -m, m).astype(ML[name]).view(np.uint8)
        nan = np.isnan(vals)
        assert np.isnan(got[nan].view(ML[name]).astype(np.float32)).all(), "NaN must stay NaN"
        bad = got[~nan] != want[~nan]
        assert not bad.any(), (f"{bad.sum()} mismatches, e.g. x={vals[~nan][bad][:6]} "
                               f"got={got[~nan][bad][:6]} want={want[~nan][bad][:6]}")


@pytest.mark.parametrize("cc,want", [(None, "software"), ("8.9", "software"),
                                     ("9.0", fp8.HARDWARE_CAST), ((10, 0), fp8.HARDWARE_CAST)])
def test_kernel_cast_policy(cc, want):
    assert fp8.kernel_cast_name(cc) == want
    with pytest.raises(ValueError, match="software"):
        fp8.kernel_cast("fast")
