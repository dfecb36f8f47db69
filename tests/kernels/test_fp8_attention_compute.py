"""``--fp8-attention-compute``: the option, its validation at engine build, and the
``pallas`` backend passing it to the Mosaic GPU prefill kernel (which runs fp8 products
only there; elsewhere the dequantizing kernels run). Fast: no kernel runs here."""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jfp8kv.kernels as kernels
from jfp8kv.cli import add_engine_args, configs_from_args
from jfp8kv.config import CacheOptions

from .cases import attention_case, make_cfg


def test_the_flag_reaches_the_cache_options():
    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--fp8-attention-compute", "fp8", "--kv-cache-dtype", "fp8_e4m3"])
    _, cache, _ = configs_from_args(args)
    assert cache.fp8_attention_compute == "fp8"
    assert CacheOptions().fp8_attention_compute == "dequant"  # the default until the GPU says


def test_an_unknown_compute_names_the_choices():
    with pytest.raises(ValueError, match=r"fp8_attention_compute.*\['dequant', 'fp8'\]"):
        CacheOptions(fp8_attention_compute="fast")


@pytest.mark.parametrize("storage,mode", [("float8_e4m3fn", "token"),
                                          ("float8_e4m3fn", "tensor"),
                                          ("float8_e4m3fn", "channel")])
def test_fp8_products_are_set_on_e4m3_pages(storage, mode):
    assert kernels.attention_compute(storage, "fp8") == "fp8"
    assert kernels.attention_compute(storage, "dequant") == "dequant"
    cfg = make_cfg(storage, mode, heads_kv=2, head_dim=64, page_size=16, num_pages=4)
    kernels.check_kv_cache(dataclasses.replace(cfg, attention_compute="fp8"))  # no refusal


@pytest.mark.parametrize("storage,mode", [("float8_e5m2", "token"),
                                          ("float8_e4m3fn", "block")])
def test_fp8_products_refuse_other_fp8_pages_at_build(storage, mode):
    cfg = make_cfg(storage, mode, heads_kv=2, head_dim=64, page_size=16, num_pages=4)
    with pytest.raises(ValueError, match="fp8_e4m3.*token, tensor or channel.*'dequant'"):
        kernels.check_kv_cache(dataclasses.replace(cfg, attention_compute="fp8"))


def test_fp8_products_are_ignored_for_16_bit_pages(caplog):
    assert kernels.attention_compute("bfloat16", "fp8") == "dequant"
    assert "ignored" in caplog.text


@pytest.mark.parametrize("compute", ["dequant", "fp8"])
def test_the_pallas_backend_hands_the_compute_to_the_mosaic_kernel(monkeypatch, compute):
    from jfp8kv.kernels import mosaic_prefill

    seen = {}
    monkeypatch.setattr(kernels, "mosaic_prefill_runs", lambda cfg, nh: True)
    monkeypatch.setattr(mosaic_prefill, "prefill_attention",
                        lambda q, *a, tuning=None: (seen.setdefault("tuning", tuning), q)[1])
    cfg = make_cfg("float8_e4m3fn", "tensor", heads_kv=2, head_dim=64, page_size=16,
                   num_pages=4)
    cfg = dataclasses.replace(cfg, attention_compute=compute)
    case_ = attention_case(np.random.default_rng(), cfg, np.array([8]), 1)
    q = jnp.zeros((1, 8, 4, 64), jnp.bfloat16)
    kernels.paged_attention(q, case_.clean, case_.page_tables, case_.seq_lens,
                            jnp.asarray(np.arange(8)[None], jnp.int32), cfg, 0.1, "pallas")
    tuning = seen["tuning"]
    assert (tuning.compute if tuning else "dequant") == compute
