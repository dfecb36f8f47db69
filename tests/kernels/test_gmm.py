"""Pallas grouped matmul (``pallas_gmm.gmm``) vs its twin ``jax.lax.ragged_dot``.

Fresh random operands and group sizes per run (empty groups, one group owning every row,
fewer rows than a tile, one group, 64/128 groups, rows past the groups' sum), K and N off
the tile grid (masked edges), both grid orders (``columns_inner``) and the wider tiles
``bench.gmm_tuning`` sweeps; the interpret mode pre-fills the output with NaN, so a row
or column the kernel does not write fails the finiteness check. f32 operands must match to
f32 summation order; bf16 operands with an f32 result likewise (exact products, f32 sums);
a bf16 result within one bf16 rounding. Then random:qwen3-moe-tiny and
random:deepseek-v2-tiny give the same logits through ``pallas_interpret`` as through
``reference`` (the MoE layers' grouped matmuls included).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import grouped_matmul, pallas_gmm

from .cases import assert_close, make_cfg, on_cpu, on_exec, prefill_layout, sweep

T = pallas_gmm.GmmTuning
# (M, K, N, E, dtype, result dtype, sizes kind, tuning)
CASES = [
    (70, 48, 40, 6, "float32", "float32", "with-empty", T(tm=16, tn=32, tk=32)),
    (5, 32, 32, 3, "bfloat16", "float32", "random", T(tm=16, tn=32, tk=32)),  # M < tm
    (90, 64, 64, 4, "bfloat16", "bfloat16", "one-group", T(tm=32, tn=32, tk=32)),
    (33, 40, 24, 1, "float32", "float32", "all", T(tm=16, tn=16, tk=16)),  # E = 1, K/N masked
    (200, 32, 32, 64, "bfloat16", "float32", "random", T(tm=16, tn=32, tk=32)),
    (300, 32, 48, 128, "float32", "float32", "short-sum", T(tm=16, tn=32, tk=32)),  # zero tail
    (128, 64, 64, 8, "float32", "float32", "random", T()),  # default tuning
    # the column-inner grid (zero tail, empty groups) and bench.gmm_tuning's wider tiles:
    (300, 32, 48, 128, "float32", "float32", "short-sum",
     T(tm=16, tn=16, tk=16, columns_inner=True)),
    (70, 48, 40, 6, "bfloat16", "float32", "with-empty",
     T(tm=32, tn=16, tk=32, columns_inner=True)),
    (100, 136, 72, 8, "bfloat16", "float32", "random", T(tm=32, tn=256, tk=128, num_warps=8)),
    # GPU only:
    (4096, 2048, 1408, 64, "bfloat16", "float32", "random", T()),
    (384, 2048, 768, 128, "bfloat16", "float32", "with-empty", T(tm=16, tn=128, tk=64)),
    (3000, 200, 136, 16, "float32", "float32", "short-sum", T(tm=64, tn=64, tk=32)),
    # few rows per expert (DeepSeek-V4's prefill regime at a CPU-checkable size):
    (768, 1024, 512, 64, "bfloat16", "float32", "random", T(tm=32, columns_inner=True)),
    (768, 1024, 512, 64, "bfloat16", "float32", "random", T(tn=256, num_warps=8)),
    (768, 1024, 512, 64, "bfloat16", "float32", "random", T(tk=128, num_warps=8)),
    (3072, 1024, 512, 64, "bfloat16", "float32", "random", T(tn=256, num_warps=8,
                                                              columns_inner=True)),
]
IDS = [f"M{c[0]}-K{c[1]}-N{c[2]}-E{c[3]}-{c[4]}->{c[5]}-{c[6]}-tm{c[7].tm}-tn{c[7].tn}"
       f"-tk{c[7].tk}-w{c[7].num_warps}" + ("-cols" if c[7].columns_inner else "")
       for c in CASES]


def draw_sizes(rng, m: int, e: int, kind: str) -> np.ndarray:
    """int32[E] group sizes summing to M (``short-sum``: fewer, rows past the sum are 0)."""
    if kind == "one-group":
        sizes = np.zeros(e, np.int64)
        sizes[rng.integers(e)] = m
    elif kind == "all":
        sizes = np.array([m] + [0] * (e - 1))
    else:
        total = m - int(rng.integers(1, m // 4 + 2)) if kind == "short-sum" else m
        p = rng.dirichlet(np.ones(e))
        if kind == "with-empty":
            p[rng.choice(e, size=max(1, e // 3), replace=False)] = 0.0
            p /= p.sum()
        sizes = rng.multinomial(total, p)
    return sizes.astype(np.int32)


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=range(10)))
def test_gmm_matches_ragged_dot(case, exec_mode):
    m, k, n, e, dtype, out_dtype, kind, tuning = case
    rng = np.random.default_rng()
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((e, k, n)), dtype)
    sizes = jnp.asarray(draw_sizes(rng, m, e, kind))
    got = on_exec(exec_mode, functools.partial(
        pallas_gmm.gmm, preferred_element_type=jnp.dtype(out_dtype), tuning=tuning),
        lhs, rhs, sizes)
    ref = on_cpu(functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32),
                 lhs, rhs, sizes)
    assert got.shape == (m, n) and got.dtype == jnp.dtype(out_dtype)
    got, ref = np.asarray(got, np.float32), np.asarray(ref)
    assert np.isfinite(got).all(), f"{(~np.isfinite(got)).sum()} unwritten/non-finite"
    tail = int(np.asarray(sizes).sum())
    assert (got[tail:] == 0).all()  # rows past the groups' sum: zeros, as ragged_dot
    if out_dtype == "float32":
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    else:  # one bf16 rounding of the f32 sum
        np.testing.assert_allclose(got, ref, rtol=2 ** -8, atol=1e-6)


def test_dispatch_and_bad_input():
    """``kernels.grouped_matmul`` routes by backend (reference: ragged_dot bit for bit);
    tiles that are not powers of two >= 16 and mismatched shapes are ValueErrors."""
    rng = np.random.default_rng()
    lhs = jnp.asarray(rng.standard_normal((20, 16)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 16, 16)), jnp.float32)
    sizes = jnp.asarray([7, 0, 13], jnp.int32)
    ref = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    got = grouped_matmul(lhs, rhs, sizes, jnp.float32, "reference")
    assert (np.asarray(got) == np.asarray(ref)).all()
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        grouped_matmul(lhs, rhs, sizes, jnp.float32, "cuda")
    with pytest.raises(ValueError, match="power of two >= 16, got 24"):
        pallas_gmm.gmm(lhs, rhs, sizes, tuning=pallas_gmm.GmmTuning(tm=24), interpret=True)
    with pytest.raises(ValueError, match=r"lhs \[M, K\], rhs \[E, K, N\]"):
        pallas_gmm.gmm(lhs, rhs[:, :8], sizes, interpret=True)


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def _logits(params, cache, tok, pos, slots, pt, lens, *, cfg, backend):
    from jfp8kv.models import mla, transformer

    forward = mla.forward if cfg.is_mla else transformer.forward  # the latent model
    hidden, _ = forward(params, cache, tok, pos, slots, pt, lens, cfg=cfg, backend=backend)
    return transformer.logits(params, hidden)


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "deepseek-v2-tiny"])
def test_moe_tiny_pallas_interpret_matches_reference_backend(preset):
    """Both tiny presets' two layers (dense, then routed), float32 weights and cache (the
    attention kernels are IEEE f32 too, so agreement is to f32 rounding): a two-sequence,
    unequal-length prefill over shuffled pages gives the same logits through
    ``pallas_interpret`` (attention kernels and ``pallas_gmm``) as through ``reference``."""
    from jfp8kv.kvcache.cache import KVCache
    from jfp8kv.models.loader import load_model

    loaded = load_model(f"random:{preset}", "float32")
    mcfg = loaded.config
    assert any("router" in lp for lp in loaded.params["layers"])
    rng = np.random.default_rng()
    page, num_pages, lens = 8, 12, np.array([13, 6], np.int32)
    if mcfg.is_mla:
        ccfg = dataclasses.replace(make_cfg("float32", None, heads_kv=1,
                                            head_dim=mcfg.latent_dim, page_size=page,
                                            num_pages=num_pages), layout="latent")
    else:
        ccfg = make_cfg("float32", None, heads_kv=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
                        page_size=page, num_pages=num_pages)
    ccfg = dataclasses.replace(ccfg, num_layers=mcfg.num_layers)
    pt, pos, slots = prefill_layout(rng, lens, page, num_pages, max_pages=3)
    tok = rng.integers(0, mcfg.vocab_size, pos.shape).astype(np.int32)
    got = {b: np.asarray(_logits(loaded.params, KVCache.init(ccfg), tok, pos, slots, pt, lens,
                                 cfg=mcfg, backend=b))
           for b in ("reference", "pallas_interpret")}
    for i, n in enumerate(lens):
        ref = got["reference"][i, :n]
        scale = float(np.abs(ref).max())
        assert scale > 0
        assert_close(got["pallas_interpret"][i, :n] / scale, ref / scale, exact_f32=True)
