"""Pallas paged decode attention vs the reference twin, in interpret mode and on a GPU.

Every case draws fresh random pages, scales, queries and lengths (with an empty slot,
a length-1 sequence and lengths off the page grid), shuffles the page table, fills every
slot no sequence may see with NaN (scales too), and checks the kernel's output (which the
interpret mode pre-fills with NaN, so an unwritten element fails) against the reference on
a clean copy. Shapes cover page sizes 8..128, head_dim 64/128/256, GQA groups 1..8
(3 and 9/3 too), one split and several.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import pallas_decode, reference
from jfp8kv.kvcache import k_transform
from jfp8kv.kernels.tiles import Variant

from .cases import (assert_close, attention_case, decode_lengths, has_gpu, make_cfg, on_cpu,
                    on_exec, sweep)

ref_decode = jax.jit(reference.decode_attention, static_argnums=(4, 5))

# (storage, scale mode, page_size, head_dim, num_heads, num_kv_heads, num_splits, block_k)
CASES = [
    ("bfloat16", None, 16, 128, 8, 2, 0, 32),
    ("float32", None, 32, 64, 2, 2, 2, 16),
    ("float8_e4m3fn", "tensor", 16, 128, 8, 2, 4, 32),
    ("float8_e4m3fn", "token", 128, 64, 8, 1, 2, 64),
    ("float8_e4m3fn", "block", 16, 128, 8, 2, 2, 32),
    ("float8_e5m2", "token", 8, 64, 9, 3, 0, 16),
    ("float8_e4m3fn", "channel", 8, 256, 4, 2, 1, 16),
    # GPU only (native runs are cheap):
    ("float16", None, 8, 64, 9, 3, 1, 16),
    ("float8_e4m3fn", "token", 16, 128, 8, 2, 1, 32),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, 0, 64),
    ("float8_e5m2", "block", 32, 64, 4, 2, 1, 32),
    ("float8_e5m2", "tensor", 16, 128, 8, 2, 2, 16),
    ("bfloat16", None, 64, 128, 32, 8, 0, 64),
    ("float8_e4m3fn", "tensor", 32, 128, 16, 1, 0, 128),
]
IDS = [f"{c[0]}-{c[1]}-S{c[2]}-D{c[3]}-H{c[4]}_{c[5]}-ns{c[6]}-bk{c[7]}" for c in CASES]


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=range(7)))
def test_decode_matches_reference(case, exec_mode, variant=None, rotation="none",
                                  split_loop=False):
    storage, mode, s, d, nh, hkv, ns, bk = case
    rng = np.random.default_rng()
    lens, max_pages, num_pages = decode_lengths(rng, s, 150)
    cfg = dataclasses.replace(make_cfg(storage, mode, heads_kv=hkv, head_dim=d, page_size=s,
                                       num_pages=num_pages), kv_rotation=rotation)
    case_ = attention_case(rng, cfg, lens, max_pages)
    q_dtype = np.float32 if storage == "float32" else "bfloat16"
    q = jnp.asarray(rng.standard_normal((len(lens), nh, d)), q_dtype)
    sm_scale = 1.0 / np.sqrt(d)
    if variant is None:
        variant = pallas_decode.default_tuning(cfg).variant
    if split_loop:
        variant = dataclasses.replace(variant, split_loop=True)
    tuning = pallas_decode.DecodeTuning(block_k=bk, num_splits=ns, variant=variant)
    out = on_exec(exec_mode, pallas_decode.decode_attention, q, case_.poisoned,
                  case_.page_tables, case_.seq_lens, cfg, sm_scale, tuning=tuning)
    ref = on_cpu(ref_decode, k_transform.query_rows(q, cfg), case_.clean, case_.page_tables,
                 case_.seq_lens, cfg, sm_scale)
    assert_close(out, ref, exact_f32=storage == "float32")
    empty = np.asarray(case_.seq_lens) == 0
    assert (np.asarray(out, np.float32)[empty] == 0).all(), "empty slots must return zeros"


@pytest.mark.parametrize("variant", [
    Variant(rowscale=True), Variant(page_prefetch=True, rowscale=True, vmask=True)], ids=str)
def test_decode_rowscale_variant_interpret(variant):
    """Token scales applied to the K/V tile rows (a prepared variant, not a default)."""
    test_decode_matches_reference(CASES[5], "interpret", variant)


@pytest.mark.parametrize("case", [CASES[i] for i in (2, 5)], ids=[IDS[i] for i in (2, 5)])
def test_decode_nomma_variant_interpret(case):
    """q.K and P.V as f32 multiply-reduce over next_pow2(G) rows (GQA 4 and 3; a prepared
    variant, not a default)."""
    test_decode_matches_reference(case, "interpret", Variant(page_prefetch=True, nomma=True))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [
    Variant(), Variant(asm=True), Variant(vmask=True), Variant(page_prefetch=True, vmask=True),
    Variant(asm=True, rowscale=True), Variant(page_prefetch=True, asm=True, vmask=True),
    Variant(page_prefetch=True, asm=True, nomma=True)], ids=lambda v: str(v) or "plain")
@pytest.mark.parametrize("case", [CASES[i] for i in (3, 4, 11)],
                         ids=[IDS[i] for i in (3, 4, 11)])
def test_decode_codegen_variants_gpu(case, variant):
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    test_decode_matches_reference(case, "gpu", variant)


@pytest.mark.parametrize("batch,kv_heads,max_tokens,expect_min", [
    (1, 8, 131072, 32), (64, 8, 8192, 1), (8, 8, 32768, 4)])
def test_choose_splits_fills_the_gpu(batch, kv_heads, max_tokens, expect_min):
    t = pallas_decode.DecodeTuning()
    ns = pallas_decode.choose_splits(batch, kv_heads, max_tokens, t)
    assert ns >= expect_min and ns & (ns - 1) == 0
    assert max_tokens // ns >= 2 * t.block_k


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_default_tuning_skips_splits_in_one_wave(storage):
    """The defaults: no split (no combine pass) when batch * kv_heads is one resident wave
    of at least 1.5 programs per SM (Qwen3-0.6B at B=32: 256 pairs); splits below that
    (B=8) and above it (B=64), at any context."""
    cfg = make_cfg(storage, "token", heads_kv=8, head_dim=128, page_size=16, num_pages=8)
    t = pallas_decode.default_tuning(cfg)
    assert pallas_decode.choose_splits(32, 8, 4096, t) == 1
    assert pallas_decode.choose_splits(8, 8, 4096, t) > 1
    assert pallas_decode.choose_splits(64, 8, 4096, t) > 1
    assert pallas_decode.choose_splits(32, 8, 4096, pallas_decode.DecodeTuning()) > 1


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=range(7)))
def test_decode_split_loop_matches_reference(case, exec_mode):
    """Full tiles in an unmasked loop of their own (``Variant.split_loop``), the rest masked:
    the poisoned slots past each length must still never reach the output."""
    test_decode_matches_reference(case, exec_mode, split_loop=True)


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=(0, 1, 2, 4, 6)))
def test_decode_rotates_the_queries_in_the_kernel(case, exec_mode):
    """kv_rotation 'hadamard': the kernel takes q in the model's basis and rotates it
    (``tiles.QueryRotation``) as ``k_transform.query_rows`` does before the reference."""
    test_decode_matches_reference(case, exec_mode, rotation="hadamard")
