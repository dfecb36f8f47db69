"""Pallas MLA latent attention vs its twin ``mla_reference.latent_attention``.

As the dense kernel tests (``cases``): fresh random latent pages, scales, queries and
lengths (an empty slot, a length-1 sequence, lengths off the page grid), a shuffled page
table, every slot no sequence may see filled with NaN (scales too) in the copy the kernel
reads, the output pre-filled with NaN by the interpret mode; the reference reads a clean
copy. Decode (T == 1, one split and several) and prefill/extend (T > 1, causal by position,
ragged chunks) over bf16, f32 and fp8 (e4m3 and e5m2, token and block scales) rows, for
R = 576 (512 + 64, DeepSeek-V2-Lite) and small R, head counts that fill whole head blocks
and ones that do not.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kernels import (BACKENDS, check_latent_cache, latent_attention, mla_reference,
                            pallas_mla)

from .cases import (assert_close, attention_case, make_cfg, on_cpu, on_exec, prefill_layout,
                    sweep)

ref_latent = jax.jit(mla_reference.latent_attention, static_argnums=(6, 7, 8))

# (storage, scale mode, page_size, kv_lora_rank, rope dim, heads, T, block_m, splits, block_k)
CASES = [
    ("bfloat16", None, 16, 64, 32, 16, 1, 16, 0, 16),
    ("float8_e4m3fn", "token", 8, 32, 32, 5, 1, 16, 2, 16),
    ("float8_e4m3fn", "block", 16, 64, 32, 20, 1, 16, 1, 32),
    ("float8_e4m3fn", "block", 16, 512, 64, 16, 1, 16, 2, 32),
    ("float32", None, 8, 32, 32, 3, 4, 16, 1, 16),
    ("float8_e5m2", "token", 16, 64, 32, 4, 3, 16, 2, 16),
    # GPU only (native runs are cheap):
    ("bfloat16", None, 64, 512, 64, 16, 1, 0, 0, 32),
    ("float8_e4m3fn", "token", 64, 512, 64, 16, 1, 0, 0, 32),
    ("float8_e4m3fn", "block", 64, 512, 64, 128, 1, 0, 0, 32),
    ("float8_e4m3fn", "block", 16, 512, 64, 16, 7, 0, 1, 32),
    ("bfloat16", None, 16, 512, 64, 16, 9, 32, 0, 32),
    ("float8_e5m2", "block", 32, 64, 32, 9, 1, 0, 2, 64),
]
IDS = [f"{c[0]}-{c[1]}-S{c[2]}-R{c[3]}+{c[4]}-H{c[5]}-T{c[6]}-bm{c[7]}-ns{c[8]}-bk{c[9]}"
       for c in CASES]


def latent_case(rng, storage, mode, s, rank, rope, batch_lens):
    """(cfg, clean (pages, scale), poisoned (pages, scale), page tables, seq lens)."""
    max_pages = max(2, -(-max(batch_lens) // s))
    num_pages = 1 + sum(-(-int(n) // s) for n in batch_lens) + 2
    cfg = dataclasses.replace(make_cfg(storage, mode, heads_kv=1, head_dim=rank + rope,
                                       page_size=s, num_pages=num_pages), layout="latent")
    c = attention_case(rng, cfg, batch_lens, max_pages)
    return (cfg, (c.clean.k, c.clean.k_scale), (c.poisoned.k, c.poisoned.k_scale),
            c.page_tables, c.seq_lens)


def draw_lengths(rng, s, cap):
    lens = np.array([0, 1, int(rng.integers(2, cap)), cap, int(rng.integers(2, s + 3))])
    rng.shuffle(lens)
    return lens


def queries(rng, lens, t, nh, width, dtype):
    """q [B, T, H, R] and positions [B, T]: each row's chunk ends at its length (decode:
    the last token); an empty slot gets position 0 (it sees no key: its length is 0)."""
    q = jnp.asarray(rng.standard_normal((len(lens), t, nh, width)), dtype)
    pos = np.maximum(np.asarray(lens)[:, None] - t + np.arange(t)[None, :], 0)
    return q, jnp.asarray(pos, jnp.int32)


@pytest.mark.parametrize("case,exec_mode", sweep(CASES, IDS, cpu_subset=range(6)))
def test_latent_attention_matches_reference(case, exec_mode):
    storage, mode, s, rank, rope, nh, t, bm, ns, bk = case
    rng = np.random.default_rng()
    lens = draw_lengths(rng, s, max(2, -(-100 // s)) * s)
    cfg, clean, poisoned, pt, seq_lens = latent_case(rng, storage, mode, s, rank, rope, lens)
    q_dtype = np.float32 if storage == "float32" else "bfloat16"
    q, pos = queries(rng, lens, t, nh, rank + rope, q_dtype)
    sm_scale = 1.0 / np.sqrt(rank + rope)
    tuning = dataclasses.replace(pallas_mla.default_tuning(cfg), block_m=bm, num_splits=ns,
                                 block_k=bk)
    out = on_exec(exec_mode, pallas_mla.latent_attention, q, *poisoned, pt, seq_lens, pos,
                  cfg, sm_scale, rank, tuning=tuning)
    ref = on_cpu(ref_latent, q, *clean, pt, seq_lens, pos, cfg, sm_scale, rank)
    assert out.dtype == q.dtype and out.shape == (len(lens), t, nh, rank)
    assert_close(out, ref, exact_f32=storage == "float32")
    empty = np.asarray(seq_lens) == 0
    assert (np.asarray(out, np.float32)[empty] == 0).all(), "empty slots must return zeros"


def test_dispatch_rejects_what_it_cannot_run():
    """``jfp8kv.kernels.latent_attention``: an unknown backend, an integer (bitcast) pool on
    a Pallas backend and a non-power-of-two rank are ValueErrors naming what works. (Its
    routing of decode and extend to ``pallas_mla`` is checked by the model test below.)"""
    rng = np.random.default_rng()
    lens = np.array([5, 0, 19])
    cfg, clean, _, pt, seq_lens = latent_case(rng, "bfloat16", None, 8, 32, 32, lens)
    q, pos = queries(rng, lens, 1, 4, 64, "bfloat16")
    assert "pallas" in BACKENDS
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'.*pallas"):
        latent_attention(q, *clean, pt, seq_lens, pos, cfg, 0.125, 32, backend="cuda")
    with pytest.raises(ValueError, match="bitcast_pool=False"):
        latent_attention(q, *clean, pt, seq_lens, pos, dataclasses.replace(
            cfg, bitcast_pool=True), 0.125, 32, backend="pallas_interpret")
    with pytest.raises(ValueError, match="kv_lora_rank a power of two.*reference"):
        pallas_mla.check_shapes(dataclasses.replace(cfg, head_dim=48), 48, 24)
    with pytest.raises(ValueError, match="latent cache"):
        pallas_mla.check_shapes(dataclasses.replace(cfg, layout="kv"), 64, 32)
    # the engine builder's early check: the reference takes any width, Pallas refuses a
    # 24-wide RoPE tail
    odd = dataclasses.replace(cfg, head_dim=56)
    check_latent_cache(odd, 32, "reference")
    with pytest.raises(ValueError, match="qk_rope_head_dim a power of two.*reference"):
        check_latent_cache(odd, 32, "pallas")


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def _model_logits(params, cache, tok, pos, slots, pt, lens, *, cfg, backend):
    from jfp8kv.models import mla, transformer

    hidden, cache = mla.forward(params, cache, tok, pos, slots, pt, lens, cfg=cfg,
                                backend=backend)
    return transformer.logits(params, hidden), cache


def test_deepseek_tiny_pallas_interpret_matches_reference_backend():
    """random:deepseek-v2-tiny's first layer (float32 weights, fp8 block latent cache): an
    unequal-length prefill over shuffled pages (the extend kernel), then one decode step,
    give the same logits through ``pallas_interpret`` as through ``reference``."""
    from jfp8kv.kvcache.cache import KVCache
    from jfp8kv.models.loader import load_model

    loaded = load_model("random:deepseek-v2-tiny", "float32")
    mcfg = dataclasses.replace(loaded.config, num_layers=1)  # its first (dense) layer: small
    params = {**loaded.params, "layers": loaded.params["layers"][:1]}
    rng = np.random.default_rng()
    page, num_pages, lens = 8, 12, np.array([13, 6], np.int32)
    ccfg = make_cfg("float8_e4m3fn", "block", heads_kv=1, head_dim=mcfg.latent_dim,
                    page_size=page, num_pages=num_pages)
    ccfg = dataclasses.replace(ccfg, num_layers=mcfg.num_layers, layout="latent")
    pt, pos, slots = prefill_layout(rng, lens, page, num_pages, max_pages=3)
    tok = rng.integers(0, mcfg.vocab_size, pos.shape).astype(np.int32)
    step = (tok[:, :1], lens[:, None], np.take_along_axis(pt, lens[:, None] // page, 1) * page
            + lens[:, None] % page, lens + 1)
    got = {}
    for backend in ("reference", "pallas_interpret"):
        cache = KVCache.init(ccfg)
        lg, cache = _model_logits(params, cache, tok, pos, slots, pt, lens, cfg=mcfg,
                                  backend=backend)
        lg2, _ = _model_logits(params, cache, step[0], step[1].astype(np.int32),
                               step[2].astype(np.int32), pt, step[3], cfg=mcfg,
                               backend=backend)
        got[backend] = (np.asarray(lg)[0, :lens[0]], np.asarray(lg)[1, :lens[1]],
                        np.asarray(lg2))
    for out, ref in zip(got["pallas_interpret"], got["reference"]):
        scale = float(np.abs(ref).max())  # random weights: logits well below 1
        assert np.isfinite(out).all() and scale > 0
        assert_close(out / scale, ref / scale)
