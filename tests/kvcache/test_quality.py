"""fp8 KV quality on the real model: the engine against an independent fake quantization.

``bench/fakequant.py`` re-implements the numerics contract with numpy + ml_dtypes (it imports
nothing from jfp8kv). First, on random rows, it must agree bit for bit with what the
engine's store writes and attention reads back, for every format and scale mode. Then, on
SmolLM2-135M over 128 tokens of natural text (2,048 and more in the
committed benchmark result), every scale mode of the engine's fp8 cache (e4m3; e5m2
under ``-m slow``) is compared with the same fake quantization in Hugging Face transformers
(the same GGUF weights), each side against its own unquantized run: the NLL increases must
agree within the issue's 0.1 percentage point.

Why float64. fp8 rounding makes a quantized forward pass chaotic: in float32, a last-bit
difference between XLA and PyTorch flips one fp8 rounding, which moves later values across
other rounding boundaries, and two correct implementations end up with different
*realizations* of the quantization noise, whose NLL increases differ by 0.1-0.3 pp on one
2,048-token window (docs/lab/quality.md). Computing in float64 on both sides (quantizing the
float32 rounding of K/V, as the contract says) leaves differences of ~1e-13, far below any
fp8 rounding boundary's reach, so both sides carry the same realization and must agree to
~1e-10 pp. ``python -m bench.quality_cpu --dtype float64`` does the measurement; it runs in a
subprocess because float64 needs JAX's x64 mode, a process-wide switch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import fakequant as fq
from jfp8kv.config import CacheConfig
from jfp8kv.kernels import reference
from jfp8kv.kvcache.cache import KVCache

FORMATS = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
MODES = ("tensor", "channel", "token", "block")


# -- the fake quantization itself --------------------------------------------------------------
def random_rows(rng, n, h, d):
    """[n, h, d] rows whose magnitudes span 2^-30 .. 2^20 (fp16 subnormal scales included)."""
    mag = 2.0 ** rng.uniform(-30, 20, size=(n, h, 1))
    x = rng.standard_normal((n, h, d)) * mag
    x[0] = 0.0  # an all-zero row: the scale floor
    return x.astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", MODES)
def test_fakequant_matches_engine_store_bitwise(fmt, mode):
    rng = np.random.default_rng([7, MODES.index(mode), list(FORMATS).index(fmt)])
    h, d, page, pages = 2, 64, 16, 9
    n = (pages - 1) * page
    storage = FORMATS[fmt]
    cfg = CacheConfig(1, h, d, pages, page, storage, mode)
    k, v = random_rows(rng, n, h, d), random_rows(rng, n, h, d)
    static = None
    if mode in ("tensor", "channel"):
        # Scales that leave some values saturating and others deep in the subnormals.
        static = 2.0 ** rng.uniform(-8, 4, size=(1, h, d) if mode == "channel" else (1, 1, 1))
        static = np.broadcast_to(static, (1, h, d)).astype(np.float32)
        k = k / np.abs(k).max(axis=-1, keepdims=True).clip(1e-30) * 100  # saturation happens
    layer = KVCache.init(cfg, static, static).layer(0)
    slots = jnp.arange(page, pages * page, dtype=jnp.int32)  # every slot outside the sink
    layer, _ = jax.jit(reference.store_kv, static_argnums=4)(layer, k, v, slots, cfg)
    table = jnp.arange(1, pages, dtype=jnp.int32)[None]  # [1, pages - 1]
    for x, pool, scale in ((k, layer.k, layer.k_scale), (v, layer.v, layer.v_scale)):
        got = np.asarray(reference.gather_dequantized(pool, scale, table, cfg))[0]  # [h, n, d]
        want = fq.fake_quant_rows(np.moveaxis(x, 0, 1)[None], fmt, mode,
                                  None if static is None else static[0])[0]
        assert np.isfinite(want).all()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_fakequant_dynamic_modes_never_saturate():
    rng = np.random.default_rng(3)
    x = random_rows(rng, 64, 3, 64)[None]  # [1, 64, 3, 64] as [B, H, T, D]
    for fmt, (_, fmax) in fq.FORMATS.items():
        s = fq.token_scale(x, fmt)
        assert (np.abs(x) * (np.float32(1) / s) <= fmax).all()
        sb = fq.block_scale(x, fmt)
        xb = x.reshape(*x.shape[:-1], -1, fq.BLOCK)
        assert (np.abs(xb) * (np.float32(1) / sb) <= fmax).all()
        assert (sb.astype(np.float16).astype(np.float32) == sb).all()  # fp16 values


# -- the real model ------------------------------------------------------------------------------
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
# One window: the check is agreement to ~1e-10 pp, not a quality figure (2,048+ tokens and
# every config: bench/results/quality-cpu.json, same script). 128 tokens (8 pages, 2 of
# the 64-token tiles): the subprocess took 147 s against 172 s at 256 tokens (2026-12-07,
# alone on two cores; most of the rest is compiling the 30 float64 layers per config), with
# the same agreement (~1e-13 pp) and every config's KL above 5e-3.
TOKENS = 128
_MODES = ("tensor:1.0", "channel:calib", "token", "block")
# e4m3 (the default fp8 format) in every run; e5m2's four modes repeat the same pipeline with
# the other format (its store and read-back stay bitwise-checked above in every run) and run
# under -m slow (about 50 of the subprocess's 130 s alone on two cores, 2026-12-07).
CONFIGS = [f"fp8_e4m3:{m}" for m in _MODES]
SLOW_CONFIGS = [f"fp8_e5m2:{m}" for m in _MODES]
NLL_TOLERANCE_PP = 0.1  # the acceptance
SAME_REALIZATION_PP = 1e-6  # what float64 on both sides actually gives (~1e-10 measured)


@pytest.fixture(scope="module")
def float64_comparison(run_slow, tmp_path_factory):
    out = tmp_path_factory.mktemp("quality") / "quality-f64.json"
    configs = CONFIGS + (SLOW_CONFIGS if run_slow else [])
    cmd = [sys.executable, "-m", "bench.quality_cpu", "--dtype", "float64",
           "--tokens", str(TOKENS), "--windows", "1", "--configs", ",".join(configs),
           "--no-plot", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout[-3000:])
    with open(out) as f:
        return json.load(f)


@pytest.mark.timeout(3000)
def test_unquantized_float64_forward_passes_agree(float64_comparison):
    base = float64_comparison["baseline"]
    assert base["max_abs_token_nll_diff"] < 1e-9, base


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("config", CONFIGS + [pytest.param(c, marks=pytest.mark.slow)
                                                for c in SLOW_CONFIGS])
def test_fp8_nll_increase_matches_fake_quantization(config, float64_comparison):
    fmt, mode = config.split(":")[:2]
    runs = {(r["kv_cache_dtype"], r["kv_scale_mode"]): r for r in float64_comparison["runs"]}
    r = runs[(fmt, mode)]
    assert r["fake_kl"] > 1e-3, r  # the quantization is really on: it moves the distributions
    assert np.isfinite([r["engine_mean_nll"], r["engine_increase_pct"]]).all(), r
    # The criterion, then what one realization on both sides really gives.
    assert abs(r["diff_pp"]) <= NLL_TOLERANCE_PP, r
    assert abs(r["diff_pp"]) <= SAME_REALIZATION_PP, r
    assert r["max_abs_token_nll_diff"] < 1e-8, r
    assert abs(r["kl_rel_diff"]) < 1e-6, r
    if mode in ("token", "block"):
        assert r["engine_saturated"] == 0, r  # dynamic scales never clip
