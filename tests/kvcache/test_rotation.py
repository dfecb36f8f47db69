"""The randomized Hadamard rotation (``jfp8kv.kvcache.rotation``) against its definition.

Oracles: the explicit matrix R = diag(s) blockdiag(H_b) / sqrt(b) built in float64 from a
Hadamard matrix checked here entry by entry (H H^T = n I), numpy's float64 matmul, and the
numpy twin (bitwise for the butterfly ``rotate``; to rounding for the queries' one-matmul
``rotate_dense``). Inputs are fresh random rows with K-like outlier channels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jfp8kv.kvcache import rotation as rot

POW2 = (16, 32, 64, 128, 256)
BLOCKDIAG = (80, 96, 112, 160, 192)


def rows(rng, shape, dtype=np.float32):
    """Random rows with a few large channels (what post-RoPE K looks like)."""
    x = rng.standard_normal(shape)
    x[..., rng.choice(shape[-1], 3, replace=False)] *= 40.0
    return x.astype(dtype)


def test_hadamard_is_orthogonal_with_pm1_entries():
    for n in (1, 2, 4, 8, 64, 256):
        h = rot.hadamard(n)
        assert set(np.unique(h)) <= {-1, 1}
        np.testing.assert_array_equal(h @ h.T, n * np.eye(n, dtype=np.int64))


@pytest.mark.parametrize("d", POW2 + BLOCKDIAG)
def test_matrix_is_orthonormal_and_block_diagonal(d):
    r = rot.matrix(d)
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-15)
    b = rot.block_size(d)
    assert b == (d if d & (d - 1) == 0 else d & -d)
    mask = np.kron(np.eye(d // b), np.ones((b, b))) == 0
    assert not r[mask].any()  # nothing mixes channels across blocks
    np.testing.assert_array_equal(np.abs(r[~mask]), np.full((~mask).sum(), 1 / np.sqrt(b)))


@pytest.mark.parametrize("d", (16, 64, 128, 256, 80, 96))
def test_rotate_equals_matrix_product_float64(d):
    with jax.enable_x64(True):
        x = rows(np.random.default_rng(d), (5, 3, d), np.float64)
        want = x @ rot.matrix(d)
        got = np.asarray(rot.rotate(jnp.asarray(x)))
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=0, atol=4e-15 * np.abs(x).max())
        back = np.asarray(rot.unrotate(jnp.asarray(got)))
        np.testing.assert_allclose(back, x, rtol=0, atol=4e-15 * np.abs(x).max())


@pytest.mark.parametrize("d", (64, 128, 96))
def test_scores_invariant(d):
    """q.k is unchanged by rotating both: to float64 rounding, and to float32 rounding."""
    rng = np.random.default_rng(1000 + d)
    q, k = rows(rng, (4, 7, d), np.float64), rows(rng, (4, 9, d), np.float64)
    ref = np.einsum("hqd,hkd->hqk", q, k)
    with jax.enable_x64(True):
        got = np.einsum("hqd,hkd->hqk", np.asarray(rot.rotate(q)), np.asarray(rot.rotate(k)))
    scale = np.abs(q).max() * np.abs(k).max() * d
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-14 * scale)
    q32, k32 = q.astype(np.float32), k.astype(np.float32)
    got32 = np.einsum("hqd,hkd->hqk", np.asarray(rot.rotate(q32), np.float64),
                      np.asarray(rot.rotate(k32), np.float64))
    ref32 = np.einsum("hqd,hkd->hqk", q32.astype(np.float64), k32.astype(np.float64))
    np.testing.assert_allclose(got32, ref32, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("dtype", (np.float32, np.float64))
@pytest.mark.parametrize("d", (64, 128, 96))
def test_numpy_twin_bitwise(d, dtype):
    x = rows(np.random.default_rng(7 * d), (3, 2, 33, d), dtype)
    with jax.enable_x64(True):
        for f, f_np in ((rot.rotate, rot.rotate_np), (rot.unrotate, rot.unrotate_np)):
            got_np = f_np(x)
            assert got_np.dtype == dtype
            got = np.asarray(f(jnp.asarray(x)))
            np.testing.assert_array_equal(got.view(np.uint8), got_np.view(np.uint8))
        # inside a larger jitted computation (as in the engine), still the same bits
        fused = jax.jit(lambda a: rot.rotate(a * 2) * 0.5)
        np.testing.assert_array_equal(np.asarray(fused(jnp.asarray(x))).view(np.uint8),
                                      rot.rotate_np(x).view(np.uint8))


def test_low_precision_inputs_compute_in_float32():
    x = rows(np.random.default_rng(3), (8, 64), np.float32)
    for dt in (jnp.bfloat16, jnp.float16):
        xl = jnp.asarray(x).astype(dt)
        got = rot.rotate(xl)
        assert got.dtype == jnp.float32
        want = rot.rotate_np(np.asarray(xl.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(got), want)
    assert rot.rotate_np(x.astype(ml_dtypes.bfloat16)).dtype == np.float32


@pytest.mark.parametrize("dtype", (np.float32, np.float64))
@pytest.mark.parametrize("d", (64, 128, 96, 80))
def test_rotate_dense_is_the_same_rotation(d, dtype):
    """The queries' one-matmul form equals the butterfly and x @ R up to rounding, returns
    the same dtype, and stays exact under jit and with another seed."""
    x = rows(np.random.default_rng([31, d, np.dtype(dtype).itemsize]), (4, 3, 17, d), dtype)
    tol = (4e-15 if dtype == np.float64 else 1e-6) * np.abs(x).max()
    with jax.enable_x64(True):
        want = x.astype(np.float64) @ rot.matrix(d)
        for seed in (rot.DEFAULT_SEED, 7):
            got = np.asarray(rot.rotate_dense(jnp.asarray(x), seed=seed))
            assert got.dtype == dtype
            np.testing.assert_allclose(got, rot.rotate_np(x, seed), rtol=0, atol=tol)
        np.testing.assert_allclose(np.asarray(rot.rotate_dense(x)), want, rtol=0, atol=tol)
        inside = jax.jit(lambda a: rot.unrotate(rot.rotate_dense(a)))(jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(inside), x, rtol=0, atol=2 * tol)


@pytest.mark.parametrize("dt", (jnp.bfloat16, jnp.float16))
@pytest.mark.parametrize("d", (64, 128, 96))
def test_rotate_dense_low_precision_accumulates_in_float32(d, dt):
    """bf16/f16 operands are exact (+-1 matrix), the sums float32: the result is the float32
    rotation of the upcast input to float32 rounding, returned in float32."""
    x = rows(np.random.default_rng([37, d]), (9, 4, d), np.float32) / 8
    xl = jnp.asarray(x).astype(dt)
    got = rot.rotate_dense(xl)
    assert got.dtype == jnp.float32
    want = rot.rotate_np(np.asarray(xl.astype(jnp.float32)).astype(np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_deterministic_and_seeded():
    s1, s2 = rot.signs(128), rot.signs(128)
    assert s1 is s2 or np.array_equal(s1, s2)
    assert set(np.unique(s1)) == {-1, 1}
    assert 40 < (s1 > 0).sum() < 88  # a fair coin, not a constant
    # pinned: the signs are part of the format (static scales are calibrated in this basis)
    assert "".join("+" if v > 0 else "-" for v in rot.signs(16)) == PINNED_SIGNS_16
    assert not np.array_equal(rot.signs(128, seed=1), s1)
    np.testing.assert_array_equal(rot.signs(64), rot.signs(128)[:64])  # one stream
    x = rows(np.random.default_rng(5), (4, 128))
    np.testing.assert_array_equal(np.asarray(rot.rotate(x)), np.asarray(rot.rotate(x)))
    assert not np.array_equal(np.asarray(rot.rotate(x, seed=1)), np.asarray(rot.rotate(x)))


def test_rotation_spreads_outlier_channels():
    """The point of it: a row with a few huge channels gets a much smaller amax/rms ratio."""
    x = rows(np.random.default_rng(11), (256, 128)).astype(np.float64)
    crest = lambda a: (np.abs(a).max(-1) / np.sqrt((a * a).mean(-1))).mean()  # noqa: E731
    assert crest(rot.rotate_np(x)) < 0.5 * crest(x)


@pytest.mark.parametrize("d", (0, -64, 8, 24, 100, 72, 7))
def test_bad_head_dim_is_a_clear_error(d):
    with pytest.raises(ValueError, match="multiple of 16|positive int"):
        rot.block_size(d)
    if d > 0:
        with pytest.raises(ValueError, match="64, 128, 256"):
            rot.rotate(np.zeros((2, d), np.float32))
        with pytest.raises(ValueError, match="64, 128, 256"):
            rot.rotate_dense(np.zeros((2, d), np.float32))


PINNED_SIGNS_16 = "----+++--+----++"


# ------------------------------------------------- the independent twin in bench.fakequant
@pytest.mark.parametrize("dtype", (np.float32, np.float64))
@pytest.mark.parametrize("d", (64, 128, 96))
def test_fakequant_rotation_is_bitwise_the_engines(d, dtype):
    """bench.fakequant re-implements the rotation from its text; both must give the same bits
    (the float64 check mode compares the engine with the fake quantization exactly)."""
    from bench import fakequant as fq

    np.testing.assert_array_equal(fq.rotation_signs(d), rot.signs(d))
    x = rows(np.random.default_rng(d + 1), (2, 3, 17, d), dtype)
    got = fq.hadamard_rotate(x)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.view(np.uint8), rot.rotate_np(x).view(np.uint8))


def test_fakequant_hook_rotates_k_and_queries_consistently():
    """In a transformers model, rotating K and the queries (no quantization) leaves the logits
    unchanged, and the quantizer sees K in the rotated basis."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench import fakequant as fq

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    fq.install(model)
    ids = torch.randint(0, 97, (1, 40))
    seen = {}

    class Spy(fq.AmaxRecorder):
        def __call__(self, layer, k, v):
            seen.setdefault((self.rotate_k, layer), k.copy())
            return super().__call__(layer, k, v)

    outs = {}
    for rotate_k in (False, True):
        fq.set_quantizer(model, Spy(rotate_k))
        with torch.no_grad():
            outs[rotate_k] = model(ids).logits.numpy()
    fq.set_quantizer(model, None)
    np.testing.assert_allclose(outs[True], outs[False], rtol=0, atol=2e-5)
    for layer in range(2):
        plain, rotated = seen[(False, layer)], seen[(True, layer)]
        np.testing.assert_allclose(rotated, fq.hadamard_rotate(plain), rtol=0, atol=1e-5)
