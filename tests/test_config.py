"""The option dataclasses: validation at construction, and flat options split over them."""

import dataclasses

import pytest

from jfp8kv.config import CacheOptions, EngineConfig, LoadConfig, split_options


@pytest.mark.parametrize("kw,match", [
    ({"page_size": 12}, "page_size must be a power of two"),
    ({"page_size": 256}, "page_size must be a power of two"),
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
    ({"max_model_len": -1}, "max_model_len must be a positive integer"),
    ({"decode_steps": 1.5}, "decode_steps must be a positive integer"),
    ({"attention_backend": "triton"}, "choose one of"),
    ({"decode_gemm_autotune": "fast"}, r"decode_gemm_autotune 'fast'; choose one of"),
    ({"decode_buckets": (8, 0)}, "decode_buckets must be positive"),
    ({"feature_executables": "lazy"}, r"feature_executables 'lazy'; choose one of.*per-mix"),
])
def test_engine_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_engine_config_is_frozen_hashable_and_normalizes_buckets():
    cfg = EngineConfig(decode_buckets=[64, 8, 8, 32])
    assert cfg.decode_buckets == (8, 32, 64)
    assert hash(cfg) == hash(EngineConfig(decode_buckets=(8, 32, 64)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 32


@pytest.mark.parametrize("kw,match", [
    ({"kv_scale_mode": "row"}, "token"),
    ({"kv_scales": 0.0}, "kv_scales must be positive"),
    ({"kv_scales": [1.0]}, "kv_scales must be a float, a path"),
])
def test_cache_options_reject_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        CacheOptions(**kw)


def test_split_options_layers_keywords_over_given_configs():
    base = EngineConfig(page_size=32, seed=5)
    load, cache, engine = split_options({"dtype": "float32", "kv_scales": 0.5, "seed": 1},
                                        engine=base)
    assert load == LoadConfig(dtype="float32")
    assert cache == CacheOptions(kv_scales=0.5)
    assert engine == EngineConfig(page_size=32, seed=1)
    with pytest.raises(TypeError, match="unknown engine option.*'max_num_seq'.*max_num_seqs"):
        split_options({"max_num_seq": 4})
