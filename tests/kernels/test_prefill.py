"""Pallas paged prefill/extend attention vs the reference twin (interpret mode and GPU).

Each batch row gets a chunk of T new queries at the end of its cached length (the cache
already holds them, as after the store): a fresh prefill from 0, an extend after a prefix
off the page grid, a 1-token chunk, an empty slot (positions -1, length 0) and a chunk
shorter than T (padding queries). Unseen slots are NaN-poisoned as in the decode test.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import pallas_prefill, reference
from jfp8kv.kvcache import k_transform
from jfp8kv.kernels.tiles import Variant

from .cases import assert_close, attention_case, make_cfg, on_cpu, on_exec, sweep

ref_attention = jax.jit(reference.paged_attention, static_argnums=(5, 6))

CASES = [  # (storage, mode, page_size, head_dim, num_heads, kv_heads, T, block_m, block_k, variant)
    ("bfloat16", None, 16, 64, 8, 2, 24, 32, 16, ""),
    ("float8_e4m3fn", "token", 8, 64, 9, 3, 13, 16, 32, "rowscale+vmask"),
    ("float8_e4m3fn", "channel", 16, 128, 4, 2, 20, 32, 32, ""),
    ("float8_e5m2", "block", 32, 64, 4, 1, 17, 16, 16, "vmask"),
    ("float8_e4m3fn", "token", 16, 64, 4, 2, 20, 64, 128, ""),  # the fp8 default's key tile
    # GPU only ("asm": inline PTX upcast):
    ("float32", None, 16, 64, 2, 2, 20, 16, 16, ""),
    ("float8_e4m3fn", "tensor", 16, 128, 32, 8, 64, 128, 64, "asm"),
    ("float8_e4m3fn", "token", 64, 128, 32, 8, 100, 64, 64, ""),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, 100, 128, 64, "asm+vmask"),
    ("float8_e5m2", "token", 16, 128, 16, 8, 70, 64, 128, "asm"),
    ("float8_e4m3fn", "token", 16, 128, 32, 8, 96, 128, 64, "rowscale"),
    ("bfloat16", None, 16, 128, 32, 8, 128, 128, 64, ""),
    ("float8_e4m3fn", "block", 16, 256, 8, 2, 33, 64, 32, "asm"),
]
IDS = [f"{c[0]}-{c[1]}-S{c[2]}-D{c[3]}-H{c[4]}_{c[5]}-T{c[6]}-bm{c[7]}-bk{c[8]}"
       + (f"-{c[9]}" if c[9] else "") for c in CASES]


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=range(5)))
def test_prefill_matches_reference(case, exec_mode, extra_variant="", rotation="none"):
    storage, mode, s, d, nh, hkv, t, bm, bk, variant = case
    variant = "+".join(filter(None, (variant, extra_variant)))
    rng = np.random.default_rng()
    prefix = [0, int(rng.integers(1, 3 * s)) | 1, int(rng.integers(0, 40)), 0, 5]
    chunk = [t, t, 1, 0, max(1, t - 3)]  # new tokens per row (<= T)
    lens = np.array([p + c for p, c in zip(prefix, chunk)])
    max_pages = int(max(-(-int(n) // s) for n in lens)) + 1
    num_pages = 1 + sum(-(-int(n) // s) for n in lens) + 2
    cfg = dataclasses.replace(make_cfg(storage, mode, heads_kv=hkv, head_dim=d, page_size=s,
                                       num_pages=num_pages), kv_rotation=rotation)
    case_ = attention_case(rng, cfg, lens, max_pages)
    pos = np.full((len(lens), t), -1, np.int32)
    for i, (p, c) in enumerate(zip(prefix, chunk)):
        pos[i, :c] = np.arange(p, p + c)
        pos[i, c:] = p + c - 1  # padding queries repeat the last position (any value works)
    pos[3] = -1  # empty slot
    q_dtype = np.float32 if storage == "float32" else "bfloat16"
    q = jnp.asarray(rng.standard_normal((len(lens), t, nh, d)), q_dtype)
    sm_scale = 1.0 / np.sqrt(d)
    tuning = pallas_prefill.PrefillTuning(block_m=bm, block_k=bk, variant=Variant.parse(variant))
    out = on_exec(exec_mode, pallas_prefill.prefill_attention, q, case_.poisoned,
                  case_.page_tables, case_.seq_lens, jnp.asarray(pos), cfg, sm_scale,
                  tuning=tuning)
    ref = on_cpu(ref_attention, k_transform.query_rows(q, cfg), case_.clean,
                 case_.page_tables, case_.seq_lens, jnp.asarray(pos), cfg, sm_scale)
    assert_close(out, ref, exact_f32=storage == "float32")
    assert (np.asarray(out, np.float32)[3] == 0).all(), "a row with no visible key is zero"


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=range(5)))
def test_prefill_split_loop_matches_reference(case, exec_mode):
    """Keys every query row sees run first in an unmasked loop (``Variant.split_loop``)."""
    test_prefill_matches_reference(case, exec_mode, "split")


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=range(5)))
def test_prefill_rotates_the_queries_in_the_kernel(case, exec_mode):
    """kv_rotation 'hadamard': the kernel rotates the queries itself (as the reference's
    ``k_transform.query_rows``), on the fp8 default's split loop too."""
    test_prefill_matches_reference(case, exec_mode, "split", rotation="hadamard")
