"""The store kernel with the fused q/k prologue (norm + RoPE) vs its twins run one by one:
``prologue.apply`` then the reference store (pages and dynamic scales NaN-poisoned first,
padding lanes and a token count off the block size included), and against a float64 numpy
RMS norm + rotate-half RoPE written here.

The kernel's arithmetic is the twins' (same operations, rounding to bf16 after the norm
and after RoPE), but XLA may keep the normalized rows in float32 across a fused norm and
RoPE (``xla_allow_excess_precision``, on by default: then about a third of the queries
differ in their last bit), contract a multiply-add into an FMA, and on the GPU the row
sums and rsqrt are Triton's. So the queries are compared within one bf16 ulp of their
row's largest element, and stored K, dequantized, within one storage step of its row's
range; V, its scales, the NaN-poisoned slots nobody may write and the counts are exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import pallas_store, prologue, reference
from jfp8kv.kvcache import scale_modes

from .cases import on_cpu, on_exec, poisoned_store_case, sweep

pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
CASES = [  # (storage, mode, head_dim, kv_heads, q heads per kv head, qk_norm, tokens, block_n)
    ("bfloat16", None, 64, 2, 2, True, 45, 16),
    ("float8_e4m3fn", "token", 128, 2, 3, True, 37, 32),
    ("float8_e4m3fn", "block", 64, 2, 4, False, 45, 16),
    ("float8_e4m3fn", "tensor", 64, 1, 2, True, 20, 16),
    # GPU only:
    ("float8_e4m3fn", "token", 128, 8, 2, True, 300, 32),
    ("float8_e5m2", "channel", 128, 4, 8, False, 100, 32),
    ("float8_e4m3fn", "block", 128, 8, 4, True, 513, 32),
    # CPU again: block with q/k norm at the engine's 8 tokens per program
    ("float8_e4m3fn", "block", 64, 2, 2, True, 24, 8),
]
IDS = [f"{c[0]}-{c[1]}-D{c[2]}-Hkv{c[3]}-G{c[4]}-{'norm' if c[5] else 'nonorm'}-N{c[6]}"
       for c in CASES]


def _inputs(rng, case):
    storage, mode, d, hkv, g, norm, n, _ = case
    s = 16
    cfg, layer, slots = poisoned_store_case(rng, storage, mode, heads_kv=hkv, head_dim=d,
                                            page_size=s, new_tokens=n)
    slots[rng.choice(n, size=2, replace=False)] = rng.integers(0, s, size=2)  # padding lanes
    rows = lambda h: jnp.asarray(rng.standard_normal((n, h, d)) * rng.uniform(  # noqa: E731
        0.1, 4.0, (n, h, 1)), jnp.bfloat16)
    q, k, v = rows(hkv * g), rows(hkv), rows(hkv)
    positions = jnp.asarray(rng.integers(0, 40_000, n), jnp.int32)
    inv_freq = jnp.asarray(1.0 / 1e6 ** (np.arange(0, d, 2) / d), jnp.float32)
    cos, sin = prologue.rope_tables(positions, inv_freq)
    def weight():
        return jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.bfloat16) if norm else None

    pro = prologue.QKPrologue(cos, sin, weight(), weight(), 1e-6)
    return cfg, layer, q, k, v, pro, jnp.asarray(slots)


def _twins(cfg, layer, q, k, v, pro, slots):
    q2, k2 = prologue.apply(pro, q, k)
    layer, stats = reference.store_kv(layer, k2, v, slots, cfg)
    return q2, layer, stats


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _dequant_k(layer, cfg):
    """Stored K [Hkv, P, S, D] as float32 values (scale applied); NaN where unwritten."""
    mode = scale_modes.of(cfg)
    static = mode.name is not None and mode.is_static
    scale = layer.k_scale[:, None, None] if static else layer.k_scale
    return np.asarray(mode.dequantize(layer.k, scale))


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=(0, 1, 2, 3, 4, 7)))
def test_prologue_store_matches_twins(case, exec_mode):
    rng = np.random.default_rng()
    cfg, layer, q, k, v, pro, slots = _inputs(rng, case)
    want_q, want, want_stats = on_cpu(jax.jit(_twins, static_argnums=0), cfg, layer, q, k, v,
                                      pro, slots)
    got_q, got, got_stats = on_exec(exec_mode, pallas_store.prologue_store,
                                    jnp.concatenate([q, k, v], 1), pro, layer, slots, cfg,
                                    block_n=case[-1])
    gq, wq = np.asarray(got_q, np.float32), np.asarray(want_q, np.float32)
    assert not np.isnan(gq).any()
    row_max = np.abs(wq).max(-1, keepdims=True)
    bad = np.abs(gq - wq) > 2.0 ** -7 * row_max  # one bf16 ulp of the row's largest
    assert not bad.any(), f"q: {bad.sum()} elements off by more than a bf16 ulp"
    for field in ("v", "v_scale"):  # V is stored exactly as the twin stores it
        g, w = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
        assert g.shape == w.shape and g.dtype == w.dtype, field
        wnan = np.isnan(w.astype(np.float32))
        assert (np.isnan(g.astype(np.float32)) == wnan).all(), f"{field}: NaN positions differ"
        assert (_bits(g) == _bits(w))[~wnan].all(), field
    gk, wk = _dequant_k(got, cfg), _dequant_k(want, cfg)
    wnan = np.isnan(wk)
    assert (np.isnan(gk) == wnan).all(), "K: NaN positions differ (a slot written or missed)"
    # K' within a bf16 ulp, then one storage step: 2^-3 of the row's range for e4m3/e5m2
    step = 2.0 ** -2 if cfg.storage_dtype.startswith("float8") else 2.0 ** -6
    amax = np.nanmax(np.abs(wk), axis=-1, keepdims=True)
    assert (np.abs(gk - wk)[~wnan] <= (step * amax + 1e-6).repeat(wk.shape[-1], -1)[~wnan]).all()
    np.testing.assert_array_equal(np.asarray(got_stats)[:4], np.asarray(want_stats)[:4])


def test_prologue_twin_matches_float64_numpy():
    """``prologue.apply`` against an independent float64 RMS norm and rotate-half RoPE."""
    rng = np.random.default_rng()
    n, h, d, eps = 9, 3, 64, 1e-6
    x = rng.standard_normal((n, h, d)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    pos = rng.integers(0, 5000, n)
    inv = 1.0 / 1e4 ** (np.arange(0, d, 2) / d)
    cos, sin = prologue.rope_tables(jnp.asarray(pos), jnp.asarray(inv, jnp.float32))
    pro = prologue.QKPrologue(cos, sin, jnp.asarray(w), jnp.asarray(w), eps)
    got = np.asarray(prologue.apply(pro, jnp.asarray(x), jnp.asarray(x))[0])
    x64 = x.astype(np.float64)
    y = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + eps) * w
    # the angle rounded to float32 as the engine's is (pos * inv_freq in float32)
    ang = (pos[:, None, None].astype(np.float32)
           * np.concatenate([inv, inv]).astype(np.float32)[None, None]).astype(np.float64)
    rot = np.concatenate([-y[..., d // 2:], y[..., :d // 2]], -1)
    np.testing.assert_allclose(got, y * np.cos(ang) + rot * np.sin(ang), rtol=2e-5, atol=2e-5)


def test_prologue_store_rejects_ungrouped_heads():
    rng = np.random.default_rng()
    cfg, layer, q, k, v, pro, slots = _inputs(rng, CASES[0])
    with pytest.raises(ValueError, match="multiple"):
        pallas_store.prologue_store(jnp.concatenate([q[:, :3], k, v], 1), pro, layer, slots,
                                    cfg, interpret=True)
