"""Capacity accounting: ``bytes_per_token``, ``plan_num_pages`` and the pool agree.

The formula is restated here, independently of ``cache.py``:
    bytes/token = 2 (K and V) x layers x kv_heads x (head_dim x itemsize + scale bytes),
    scale bytes per token per head: tensor/channel 0 (static, per layer), token 4 (one
    float32), block 2 x head_dim / 32 (one fp16 per 32 elements), non-fp8 0.
Static modes add 2 x layers x kv_heads x head_dim x 4 bytes once (float32 [heads, head_dim]
K and V scales per layer). Page 0 is the reserved padding sink: the planner returns usable
pages, the pool holds one more.
"""

from __future__ import annotations

import pytest

from jfp8kv.config import CacheConfig
from jfp8kv.kvcache.cache import (
    KVCache,
    bytes_per_token,
    plan_num_pages,
    static_overhead_bytes,
)

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
FP8 = ("float8_e4m3fn", "float8_e5m2")
SHAPES = [(30, 3, 64), (1, 1, 32), (2, 8, 128), (28, 4, 128), (5, 2, 256)]  # layers, heads, d


def formula(layers, heads, d, storage, mode):
    scale = 0
    if storage in FP8:
        scale = {"tensor": 0, "channel": 0, "token": 4, "block": 2 * d // 32}[mode]
    return 2 * layers * heads * (d * ITEMSIZE[storage] + scale)


def combos():
    for storage in ITEMSIZE:
        for mode in (("tensor", "channel", "token", "block") if storage in FP8 else (None,)):
            yield storage, mode


@pytest.mark.parametrize("storage,mode", list(combos()))
def test_bytes_per_token_formula(storage, mode):
    for layers, heads, d in SHAPES:
        assert bytes_per_token(layers, heads, d, storage, mode) == formula(
            layers, heads, d, storage, mode)


def test_smollm2_135m_bf16_is_23040_bytes_per_token():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
    assert bytes_per_token(30, 3, 64, "bfloat16", None) == 23_040
    assert bytes_per_token(30, 3, 64, "float8_e4m3fn", "tensor") == 11_520


@pytest.mark.parametrize("storage", FP8)
@pytest.mark.parametrize("mode", ["tensor", "channel"])
def test_static_fp8_plans_exactly_twice_the_bf16_pages(storage, mode):
    page_size = 16
    for layers, heads, d in SHAPES:
        kw = dict(num_layers=layers, num_kv_heads=heads, head_dim=d, page_size=page_size)
        bf16_page = page_size * bytes_per_token(layers, heads, d, "bfloat16", None)
        overhead = static_overhead_bytes(layers, heads, d, storage, mode)
        assert overhead == 2 * layers * heads * d * 4
        for k in (1, 7, 1000):
            memory = k * bf16_page
            bf16 = plan_num_pages(memory, storage_dtype="bfloat16", scale_mode=None, **kw)
            fp8 = plan_num_pages(memory + overhead, storage_dtype=storage, scale_mode=mode, **kw)
            assert bf16 == k and fp8 == 2 * k
            # One byte short of the overhead costs a whole fp8 page, never more.
            short = plan_num_pages(memory + overhead - 1, storage_dtype=storage,
                                   scale_mode=mode, **kw)
            assert short == 2 * k - 1


@pytest.mark.parametrize("mode,d,ratio", [
    ("token", 64, 128 / 68), ("token", 128, 256 / 132),
    ("block", 64, 2 / (1 + 2 / 32)), ("block", 128, 2 / (1 + 2 / 32)),
])
def test_dynamic_fp8_token_ratio(mode, d, ratio):
    """Tokens held vs bf16 in the same memory: token mode 1.882x (d=64) / 1.939x (d=128),
    block mode 1.882x for any head_dim (one fp16 per 32 bytes)."""
    layers, heads, page_size = 24, 4, 16
    kw = dict(num_layers=layers, num_kv_heads=heads, head_dim=d, page_size=page_size)
    memory = 40 << 30
    bf16 = plan_num_pages(memory, storage_dtype="bfloat16", scale_mode=None, **kw)
    fp8 = plan_num_pages(memory, storage_dtype="float8_e4m3fn", scale_mode=mode, **kw)
    assert fp8 == memory // (page_size * formula(layers, heads, d, "float8_e4m3fn", mode))
    assert abs(fp8 / bf16 - ratio) < 1e-4, (fp8 / bf16, ratio)


def test_plan_never_negative():
    kw = dict(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
    assert plan_num_pages(0, storage_dtype="float8_e4m3fn", scale_mode="channel", **kw) == 0
    assert plan_num_pages(10, storage_dtype="bfloat16", scale_mode=None, **kw) == 0


@pytest.mark.parametrize("storage,mode", list(combos()))
def test_pool_bytes_agree_with_planner(storage, mode):
    """KVCache.init(cfg).nbytes() == (usable + 1 sink) x page_size x bytes/token + static
    overhead, for the page count the planner gives: the saving reaches the pool."""
    layers, heads, d, page_size = 2, 2, 64, 8
    page = page_size * formula(layers, heads, d, storage, mode)
    overhead = static_overhead_bytes(layers, heads, d, storage, mode)
    memory = 13 * page + overhead + page // 2  # not a multiple: the remainder is unused
    usable = plan_num_pages(memory, num_layers=layers, num_kv_heads=heads, head_dim=d,
                            page_size=page_size, storage_dtype=storage, scale_mode=mode)
    assert usable == 13
    cfg = CacheConfig(layers, heads, d, usable + 1, page_size, storage, mode)
    static = 0.5 if mode in ("tensor", "channel") else None
    pool = KVCache.init(cfg, static, static).nbytes()
    assert pool == (usable + 1) * page + overhead
    # The sink page lies outside the budget: the pool exceeds it by less than one page.
    assert memory - page < pool - page <= memory


def test_every_user_mode_has_one_policy_object():
    from jfp8kv.config import KV_SCALE_MODES
    from jfp8kv.kvcache import scale_modes

    assert tuple(scale_modes.MODES) == KV_SCALE_MODES
    assert {m for m in KV_SCALE_MODES if scale_modes.get(m).is_static} == {"tensor", "channel"}
    assert scale_modes.get("token", "bfloat16") is scale_modes.UNSCALED
    with pytest.raises(ValueError, match="choose one of"):
        scale_modes.get("row")
    with pytest.raises(ValueError, match="head_dim divisible by 32"):
        scale_modes.get("block").validate(48)


def test_static_scales_from_amax():
    """tensor: one scale per layer tensor (max over heads and channels); channel: per channel;
    both amax * headroom / fmax in float32, floored."""
    import numpy as np

    from jfp8kv.kvcache import scale_modes

    amax = np.random.default_rng().uniform(0, 10, (3, 2, 8)).astype(np.float32)
    amax[0, 0, 0] = 0.0
    ch = scale_modes.get("channel").static_from_amax(amax, 1.5, "float8_e4m3fn")
    np.testing.assert_array_equal(ch, np.maximum(amax * np.float32(1.5) / np.float32(448),
                                                 np.float32(1e-12)))
    te = scale_modes.get("tensor").static_from_amax(amax, 1.0, "float8_e5m2")
    np.testing.assert_array_equal(te, np.broadcast_to(
        amax.max(axis=(1, 2), keepdims=True) / np.float32(57344), amax.shape))
