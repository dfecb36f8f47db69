"""DeepSeek-V4 cache pools: the byte model against hand counts, the planner at a fixed budget
(fp8 window + compressed rows cost exactly 1.0625 / 2 of bf16's; the indexer stays bf16 and
the state float32), allocation equal to the byte model with no idle bytes beyond one page
(the planner sizes from the fp8 element size), the fp8 rows equal to the independent fake
quantization ``bench.fakequant``, and the configuration-time refusals."""

from fractions import Fraction
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from bench import fakequant
from jfp8kv.kvcache import v4_pools
from jfp8kv.kvcache.cache_tree import Cache
from jfp8kv.kvcache.layout import EXTRA_SLOTS, CacheRequest, plan_cache
from jfp8kv.models.presets import PRESETS
from jfp8kv.config import ModelConfig
from jfp8kv.models.v4_presets import TINY, v4_config

FLASH = v4_config("deepseek-v4-flash")


def test_flash_byte_model_by_hand():
    bf16 = v4_pools.V4PoolSpec.from_model(FLASH, "auto", page_size=256)
    f8 = v4_pools.V4PoolSpec.from_model(FLASH, "fp8_e4m3", page_size=256)
    # 43 layers: 0-1 window only, then 21 CSA (m=4) and 20 HCA (m=128) layers.
    entries = 21 * 256 // 4 + 20 * 256 // 128
    assert bf16.row_bytes() == 512 * 2 and f8.row_bytes() == 512 + 512 // 32 * 2
    assert bf16.compressed_bytes_per_page() == entries * 1024
    assert f8.compressed_bytes_per_page() == entries * 544
    assert bf16.indexer_bytes_per_page() == f8.indexer_bytes_per_page() == 21 * 64 * 128 * 2
    assert f8.window_bytes_per_slot() * 2 == bf16.window_bytes_per_slot() * Fraction(1.0625)
    assert f8.window_bytes_per_slot() == 43 * 128 * 544
    state = 21 * 4 * (6 * 512 + 6 * 128) * 4 + 20 * 2 * 128 * 512 * 4
    assert bf16.state_bytes_per_slot() == f8.state_bytes_per_slot() == state
    assert Fraction(bf16.compressed_bytes_per_page(), f8.compressed_bytes_per_page()) == \
        Fraction(2) / Fraction(1.0625)


def _plan(spec, budget: int, slots: int) -> int:
    """Pages (the sink page 0 not counted) that ``plan_cache`` gives ``spec``'s layout at
    ``budget`` with ``slots`` state slots in all."""
    layout = v4_pools.v4_layout(FLASH if spec.window_layers == 43 else
                                ModelConfig.from_hf_dict(TINY), CacheRequest(spec.storage_dtype))
    plan = plan_cache(layout, budget, spec.page_size, slots - EXTRA_SLOTS, spec.page_size)
    assert plan.num_slots == slots
    return plan.num_pages - 1


@pytest.mark.parametrize("slots", [3, 5])
def test_fixed_budget_gain_is_the_byte_model(slots):
    """Pages at one budget: fp8 holds exactly what the per-page bytes say (the pooled part
    alone, indexer excluded, is 2 / 1.0625 = 1.88x)."""
    bf16 = v4_pools.V4PoolSpec.from_model(FLASH, "auto")
    f8 = v4_pools.V4PoolSpec.from_model(FLASH, "fp8_e4m3")
    lcm = np.lcm(bf16.bytes_per_page(), f8.bytes_per_page())
    budget = slots * bf16.bytes_per_slot() + 7 * int(lcm)
    p16, p8 = _plan(bf16, budget, slots), _plan(f8, budget, slots)
    assert p16 == 7 * lcm // bf16.bytes_per_page()
    freed = slots * (bf16.bytes_per_slot() - f8.bytes_per_slot())  # fp8 window rows
    assert p8 == (7 * int(lcm) + freed) // f8.bytes_per_page()
    assert p8 > p16 * Fraction(bf16.bytes_per_page(), f8.bytes_per_page()) - 1
    pooled16 = p16 * bf16.compressed_bytes_per_page()
    assert Fraction(pooled16, p16 * f8.compressed_bytes_per_page()) == Fraction(32, 17)


@pytest.mark.parametrize("dtype", ["auto", "fp8_e4m3"])
def test_allocation_matches_the_plan(dtype):
    cfg = ModelConfig.from_hf_dict(TINY)
    spec = v4_pools.V4PoolSpec.from_model(cfg, dtype, page_size=16)
    layout = v4_pools.v4_layout(cfg, CacheRequest(spec.storage_dtype))
    budget = 400_000
    plan = plan_cache(layout, budget, 16, 0, 16)
    got = Cache.init(plan).pool_nbytes()
    assert got == plan.pool_bytes()
    assert got == {"compressed": plan.num_pages * spec.compressed_bytes_per_page(),
                   "indexer": plan.num_pages * spec.indexer_bytes_per_page(),
                   "window": 2 * spec.window_bytes_per_slot(),
                   "compressor": 2 * spec.state_bytes_per_slot()}
    total = sum(got.values())
    # nothing idle beyond a page: the budget holds every pool but the padding page 0
    assert total - spec.bytes_per_page() <= budget < total
    if dtype == "fp8_e4m3":  # the fp8 element size was seen before sizing
        bf16 = v4_pools.V4PoolSpec.from_model(cfg, "auto", page_size=16)
        assert plan.num_pages - 1 > _plan(bf16, budget, 2)
        assert layout.bytes_per_token(16) * 16 == (
            (16 // 4 * 2 + 16 // 8) * (32 + 2) + (16 // 4 * 2) * 32 * 2)


def test_fp8_rows_equal_fakequant():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 5, 64)) * np.exp(rng.uniform(-6, 6, (3, 5, 1)))).astype(
        np.float32)
    vals, scales = v4_pools.store_rows(jnp.asarray(x), "float8_e4m3fn")
    assert vals.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float16
    assert scales.shape == (3, 5, 2)
    got = np.asarray(v4_pools.read_rows(vals, scales, jnp.float32))
    want = fakequant.fake_quant_rows(x[:, None], "fp8_e4m3", "block")[:, 0]
    np.testing.assert_array_equal(got, want)


def test_refusals():
    qwen = ModelConfig(**PRESETS["qwen3-tiny"])
    with pytest.raises(ValueError, match="DeepSeek-V4's"):
        v4_pools.V4PoolSpec.from_model(qwen, "fp8_e4m3")
    odd = ModelConfig.from_hf_dict(dict(TINY, head_dim=48))
    with pytest.raises(ValueError, match="divisible by 32"):
        v4_pools.V4PoolSpec.from_model(odd, "fp8_e4m3", page_size=16)
    v4_pools.V4PoolSpec.from_model(odd, "auto", page_size=16)  # bf16 needs no blocks
    with pytest.raises(ValueError, match="multiple of every compress ratio"):
        v4_pools.V4PoolSpec.from_model(FLASH, "auto", page_size=64)
    with pytest.raises(ValueError, match="fp8_e4m3"):
        v4_pools.V4PoolSpec.from_model(FLASH, "fp8_e5m2")
    with pytest.raises(ValueError, match="8.9"):
        v4_pools.check_fp8_device(SimpleNamespace(platform="gpu", compute_capability="8.0"))
    v4_pools.check_fp8_device(SimpleNamespace(platform="gpu", compute_capability="9.0"))
    v4_pools.check_fp8_device(SimpleNamespace(platform="cpu"))
    spec = v4_pools.V4PoolSpec.from_model(FLASH, "auto")
    with pytest.raises(ValueError, match="max_num_seqs"):
        _plan(spec, spec.bytes_per_slot() * 4, 4)
