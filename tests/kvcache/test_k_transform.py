"""K transforms before fp8 storage (``kv_rotation``: hadamard, smooth, smooth+hadamard).

Oracles: attention through an unquantized (float32) cache without any transform (the
transforms are exact for attention: rotation keeps q.k, smoothing moves every score of a
query by the same q.shift), and the independent fake quantization ``bench.fakequant`` in
transformers, which the engine must equal in the float64 check mode (same stored numbers,
so the same fp8 roundings: logits agree to ~1e-12; the queries are rotated by a matmul in the
engine and by the butterfly in the fake quantization, the same R up to float64 rounding).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import fakequant as fq
from jfp8kv import LLM
from jfp8kv.config import CacheConfig, CacheOptions
from jfp8kv.kvcache import k_transform
from jfp8kv.kvcache.cache import KVCache
from jfp8kv.models.loader import load_model
from tests.x64 import x64

TRANSFORMS = ("hadamard", "smooth", "smooth+hadamard")


def k_like(rng, shape, dtype=np.float32):
    """Rows with large constant channels (what biased post-RoPE K looks like) plus noise."""
    x = rng.standard_normal(shape)
    x[..., :3] += np.array([60.0, -35.0, 20.0])
    return x.astype(dtype)


def attend(cfg, q, k, v, shift=None):
    """Store k, v [N, H, D] at slots 16.. (one sequence), attend q [1, T, Hq, D] at the last
    T positions; returns the output [1, T, Hq, D]."""
    n = k.shape[0]
    layer = KVCache.init(cfg, k_shift=shift).layer(0)
    slots = jnp.arange(cfg.page_size, cfg.page_size + n, dtype=jnp.int32)
    layer, _ = jax.jit(lambda *a: _store(*a, cfg))(layer, jnp.asarray(k), jnp.asarray(v),
                                                   slots)
    t = q.shape[1]
    table = jnp.arange(1, cfg.num_pages, dtype=jnp.int32)[None]
    pos = jnp.arange(n - t, n, dtype=jnp.int32)[None]
    from jfp8kv import kernels

    out = kernels.paged_attention(jnp.asarray(q), layer, table, jnp.array([n], jnp.int32),
                                  pos, cfg, 0.125)
    return np.asarray(out)


def _store(layer, k, v, slots, cfg):
    from jfp8kv import kernels

    return kernels.store_kv(layer, k, v, slots, cfg)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_transforms_leave_unquantized_attention_unchanged(name):
    rng = np.random.default_rng([11, TRANSFORMS.index(name)])
    h, d, n, t = 2, 64, 40, 7
    cfg = CacheConfig(1, h, d, 5, 16, "float32")
    k, v = k_like(rng, (n, h, d)), rng.standard_normal((n, h, d)).astype(np.float32)
    q = rng.standard_normal((1, t, 2 * h, d)).astype(np.float32)
    shift = None
    if k_transform.smooths(name):
        shift = (k.mean(axis=0) + rng.standard_normal((h, d)))[None]  # any constant works
    want = attend(cfg, q, k, v)
    got = attend(CacheConfig(1, h, d, 5, 16, "float32", kv_rotation=name), q, k, v, shift)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("backend", ("reference", "pallas_interpret"))
def test_stored_rows_are_rotate_of_k_minus_shift_bitwise(backend):
    """The cache stores exactly what the fake quantization feeds its quantizer (K in the
    model's dtype, bfloat16 here, transformed in float32; V stays bfloat16)."""
    from jfp8kv import kernels

    rng = np.random.default_rng(5)
    h, d, n = 2, 64, 32
    k = k_like(rng, (n, h, d)).astype(jnp.bfloat16)
    v = jnp.zeros((n, h, d), jnp.bfloat16)
    shift = rng.standard_normal((1, h, d)).astype(np.float32) * 30
    cfg = CacheConfig(1, h, d, 3, 16, "float32", kv_rotation="smooth+hadamard")
    layer = KVCache.init(cfg, k_shift=shift).layer(0)
    slots = jnp.arange(16, 16 + n, dtype=jnp.int32)
    layer, _ = kernels.store_kv(layer, jnp.asarray(k), v, slots, cfg, backend)
    got = np.asarray(layer.k[:, 1:]).reshape(h, n, d)
    want = fq.hadamard_rotate(np.moveaxis(np.asarray(k, np.float32), 0, 1) - shift[0][:, None])
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float32))
def test_query_rows_use_the_one_matmul_rotation(dtype):
    """Queries: ``rotation.rotate_dense`` (one matmul) cast back to q's dtype, for both
    rotating transforms; the same R as the stored K's butterfly up to rounding; smoothing
    and "none" leave them alone."""
    from jfp8kv.kvcache import rotation

    rng = np.random.default_rng(17)
    q = jnp.asarray(k_like(rng, (2, 5, 4, 64))).astype(dtype)
    for name in ("hadamard", "smooth+hadamard"):
        got = k_transform.query_rows(q, CacheConfig(1, 2, 64, 3, 16, "float32",
                                                    kv_rotation=name))
        assert got.dtype == dtype
        want = rotation.rotate_dense(q).astype(dtype)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        butterfly = np.asarray(rotation.rotate(q).astype(dtype), np.float32)
        tol = (2.0 ** -7 * np.abs(butterfly).max() if dtype == jnp.bfloat16  # one bf16 ulp
               else 1e-6 * np.abs(np.asarray(q)).max())  # float32 rounding of the sums
        np.testing.assert_allclose(np.asarray(got, np.float32), butterfly, rtol=0, atol=tol)
    for name in ("none", "smooth"):
        assert k_transform.query_rows(q, CacheConfig(1, 2, 64, 3, 16, "float32",
                                                     kv_rotation=name)) is q


# -- the engine against the independent fake quantization, float64 ----------------------------
@pytest.fixture(scope="module")
def qwen2_pair(tiny_hf_checkpoint):
    """The tiny qwen2 (q/k/v biases: constant K channels; head_dim 16) in float64, as the
    engine loads it and as transformers runs it through the fake-quant hook."""
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_hf_checkpoint("qwen2")
    with x64():
        loaded = load_model(str(path), "float64")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    fq.exact_float64(hf)
    fq.install(hf)
    return loaded, hf


def hf_logprobs(hf, ids, quantizer):
    import torch

    fq.set_quantizer(hf, quantizer)
    try:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1], -1).numpy()
    finally:
        fq.set_quantizer(hf, None)


@pytest.mark.parametrize("mode", ("token", "channel"))
@pytest.mark.parametrize("name", TRANSFORMS)
def test_engine_equals_fake_quantization_float64(qwen2_pair, name, mode):
    loaded, hf = qwen2_pair
    ids = np.random.default_rng(3).integers(3, 300, 96).tolist()
    with x64():
        llm = LLM(loaded=loaded, dtype="float64", kv_cache_dtype="fp8_e4m3",
                  kv_scale_mode=mode, kv_rotation=name, max_model_len=128,
                  kv_cache_memory=1 << 20, max_num_batched_tokens=64)
        _, logits = llm.nll(ids, return_logits=True)
        cache = llm.engine.runner.cache["kv"]
        shift = (None if cache.k_shift is None
                 else np.stack([np.asarray(s) for s in cache.k_shift]))
        sk = sv = None
        if mode == "channel":
            sk, sv = (np.stack([np.asarray(s) for s in x])
                      for x in (cache.k_scale, cache.v_scale))
    assert llm.cache_info()["kv_rotation"] == name
    assert (shift is not None) == k_transform.smooths(name)
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    got = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    quant = fq.KVQuantizer("fp8_e4m3", mode, sk, sv, rotate_k=k_transform.rotates(name),
                           k_mean=shift)
    want = hf_logprobs(hf, ids, quant)[:, :got.shape[-1]]
    base = hf_logprobs(hf, ids, None)[:, :got.shape[-1]]
    got = got[:len(want)]
    assert np.abs(want - base).max() > 1e-4  # the quantization really moves the numbers
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)


def test_calibrated_shift_is_the_fake_quantizations_mean_float64(qwen2_pair):
    """The engine's smoothing shift (``engine.calibrate.measure_amax``: chunks, pages, sums
    over several texts) is the mean of post-RoPE K that ``fakequant.MeanRecorder`` takes in
    transformers over the same token lists, pooled over all their tokens. (The float64
    comparison above feeds the engine's own shift to the fake quantization, so it cannot
    see a wrong mean.)"""
    from jfp8kv.engine.calibrate import measure_amax

    loaded, hf = qwen2_pair
    rng = np.random.default_rng()
    texts = [rng.integers(3, 300, n).tolist() for n in (70, 45)]  # unequal: pooled, not averaged
    with x64():
        got = measure_amax(loaded.config, loaded.params, texts, chunk=32,
                           kv_rotation="smooth").k_mean
    rec = fq.MeanRecorder()
    for ids in texts:
        hf_logprobs(hf, ids, rec)
    want = rec.mean()
    assert np.abs(want).max() > 0.1  # qwen2's K biases: a shift well away from zero
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


# -- errors and bookkeeping ----------------------------------------------------------------------
def test_bad_values_are_clear_errors(tmp_path, tiny_hf_checkpoint):
    with pytest.raises(ValueError, match="kv_rotation"):
        CacheOptions(kv_rotation="rotate")
    with pytest.raises(ValueError, match="kv_rotation"):
        CacheConfig(1, 2, 64, 3, 16, "float8_e4m3fn", "token", kv_rotation="hadamard2")
    with pytest.raises(ValueError, match="multiple of 16"):
        k_transform.validate("hadamard", 40)
    with pytest.raises(ValueError, match="needs k_shift"):
        KVCache.init(CacheConfig(1, 2, 64, 3, 16, "float8_e4m3fn", "token", kv_rotation="smooth"))
    with pytest.raises(ValueError, match="does not smooth"):
        KVCache.init(CacheConfig(1, 2, 64, 3, 16, "float8_e4m3fn", "token"),
                     k_shift=np.zeros((1, 2, 64), np.float32))
    loaded = load_model(str(tiny_hf_checkpoint("qwen2")), "float32")
    kw = dict(loaded=loaded, max_model_len=64, kv_cache_memory=1 << 20,
              max_num_batched_tokens=64)
    path = tmp_path / "scales.json"
    from jfp8kv.engine.calibrate import calibrate_on_text
    from jfp8kv.kvcache.calibrate import BUILTIN_TEXT

    calibrate_on_text(loaded, [BUILTIN_TEXT], kv_rotation="hadamard").to_json(str(path))
    with pytest.raises(ValueError, match="measured with kv_rotation='hadamard'"):
        LLM(kv_cache_dtype="fp8", kv_scale_mode="channel", kv_rotation="smooth",
            kv_scales=str(path), **kw)
    assert json.load(open(path))["kv_rotation"] == "hadamard"
    llm = LLM(kv_cache_dtype="fp8", kv_scale_mode="channel", kv_rotation="hadamard",
              kv_scales=str(path), **kw)
    assert llm.cache_info()["kv_rotation"] == "hadamard"
    # fp8-only: ignored (with the other fp8-only options' warning) for a 16/32-bit cache
    assert LLM(kv_cache_dtype="float32", kv_rotation="smooth", **kw
               ).cache_info()["kv_rotation"] == "none"


def test_prefix_cache_namespace_includes_the_transform(tiny_hf_checkpoint):
    loaded = load_model(str(tiny_hf_checkpoint("qwen2")), "float32")
    kw = dict(loaded=loaded, kv_cache_dtype="fp8", max_model_len=64, kv_cache_memory=1 << 20,
              max_num_batched_tokens=64)
    roots = {LLM(kv_rotation=name, **kw).engine.scheduler.prefix_cache.root
             for name in ("none",) + TRANSFORMS}
    assert len(roots) == 1 + len(TRANSFORMS)


def test_fakequant_mean_recorder_is_the_token_mean():
    rng = np.random.default_rng(9)
    a, b = k_like(rng, (1, 2, 5, 16)), k_like(rng, (1, 2, 7, 16))  # [B, H, T, D] per call
    rec = fq.MeanRecorder()
    for x in (a, b):
        rec(0, x, x)
        rec(1, 2 * x, x)
    want = np.concatenate([a, b], axis=2).astype(np.float64).mean(axis=(0, 2))
    np.testing.assert_allclose(rec.mean(), np.stack([want, 2 * want]), rtol=1e-6)
