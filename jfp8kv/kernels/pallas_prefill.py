"""Paged prefill / extend attention on the Pallas Triton backend.

A ragged chunk of T new queries per sequence attends causally over the cached prefix and
itself (``reference.paged_attention``'s contract: query (b, t) sees key j iff
j < seq_lens[b] and j <= q_positions[b, t]); K/V are read through the storage format.

One program per (batch row, KV head, block of BT queries). Its M = BT * Gp rows are
(query t, q head g) pairs of that KV head (Gp = next_pow2(G); row r is t = r // Gp,
g = r % Gp), gathered straight from q [B, T, H, D] and scattered straight into the output,
so no transpose runs outside the kernel. The key loop walks tiles of ``block_k`` tokens
from 0 to min(seq_len, max position in the block + 1), gathering K/V tiles from the page
table exactly as the decode kernel does (``pallas_decode.load_kv_tile``: same masking and
in-register dequantization). Rows that see no key (padding queries, empty slots) are zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfp8kv.config import CacheConfig
from jfp8kv.kernels.pallas_decode import (LOG2E, cols, compute_dtype_for, dot_nn, dot_nt,
                                          flat_scales, load_kv_tile, next_pow2, resolve_variant,
                                          scale_kind)
from jfp8kv.kvcache.cache import LayerKV


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """Static launch knobs: ``block_m`` rows (queries x padded group) and ``block_k`` keys."""

    block_m: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # Page indices one tile ahead (see pallas_decode "pagepf"): measured 5-20% slower for
    # prefill on the H200 (more registers, fp8 token spills), so off by default.
    page_prefetch: bool = False
    # fp8 variants, as pallas_decode.DecodeTuning.variant: "asm" (packed PTX cvt; for prefill
    # it compiles to what Triton emits anyway), "vmask" (select on the upcast V tile),
    # "rowscale" (token scales on the tile rows). Dropped for 16/32-bit pages; "asm" in
    # interpret mode. Static loop statistics: docs/kernels-notes.md.
    variant: str = ""


def default_tuning(cfg: CacheConfig) -> PrefillTuning:
    """The measured best per storage family (bench/kernels.py --sweep-prefill)."""
    return PrefillTuning()


def _prefill_kernel(len_ref, pt_ref, pos_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref, *,
                    sm_scale, page_size, num_groups, group_pad, kind, cdt, block_m, block_k,
                    scale_block, page_prefetch, variant):
    # len_ref [B]; pt_ref [B, MP]; pos_ref [B, T] i32; q_ref/o_ref [B, T, Hkv, G, D]
    # k_ref/v_ref [Hkv, P*S, D]; scales as in pallas_decode
    b, h, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t_len, d = q_ref.shape[1], q_ref.shape[-1]
    max_pages = pt_ref.shape[1]
    bt = block_m // group_pad
    r = jnp.arange(block_m, dtype=jnp.int32)
    t_idx = qb * bt + r // group_pad  # [M]
    g_idx = r % group_pad
    row_ok = (t_idx < t_len) & (g_idx < num_groups)
    row_mask = jnp.broadcast_to(row_ok[:, None], (block_m, d))

    q = plgpu.load(q_ref.at[b, t_idx[:, None], h, g_idx[:, None], cols(d)], mask=row_mask,
                   other=0.0).astype(jnp.float32)  # [M, D]
    if kind == "static":
        q = q * plgpu.load(ks_ref.at[h, cols(d)]).astype(jnp.float32)
    q = q.astype(cdt)
    qpos = plgpu.load(pos_ref.at[b, t_idx], mask=row_ok, other=-1)  # [M]
    seq_len = len_ref[b]
    kv_end = jnp.minimum(seq_len, jnp.max(qpos) + 1)
    n_iter = (jnp.maximum(kv_end, 0) + block_k - 1) // block_k
    qk_scale = sm_scale * LOG2E

    def load_pages(i):
        tok = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        slot = jnp.minimum(tok // page_size, max_pages - 1)
        return plgpu.load(pt_ref.at[b, slot], mask=tok < kv_end, other=0)

    def attend(i, acc, m_i, l_i, page):
        tok = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        valid = tok < kv_end
        rows = page * page_size + tok % page_size
        k, k_tok = load_kv_tile(k_ref, ks_ref, h, rows, valid, kind, cdt, scale_block,
                                variant.replace("vmask", ""))
        s = dot_nt(q, k)  # [M, BK]
        if k_tok is not None:
            s = s * k_tok[None, :]
        vis = valid[None, :] & (tok[None, :] <= qpos[:, None])
        s = jnp.where(vis, s * qk_scale, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        v, v_tok = load_kv_tile(v_ref, vs_ref, h, rows, valid, kind, cdt, scale_block,
                                variant)
        if v_tok is not None:
            p = p * v_tok[None, :]
        acc = acc * alpha[:, None] + dot_nn(p.astype(cdt), v)
        return acc, m_new, l_new

    acc0 = jnp.zeros((block_m, d), jnp.float32)
    m0 = jnp.full((block_m,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((block_m,), jnp.float32)
    if page_prefetch:
        def body(i, carry):
            acc, m_i, l_i, page = carry
            acc, m_i, l_i = attend(i, acc, m_i, l_i, page)
            return acc, m_i, l_i, load_pages(i + 1)

        acc, _, l_i, _ = jax.lax.fori_loop(0, n_iter, body, (acc0, m0, l0, load_pages(0)))
    else:
        def body(i, carry):
            return attend(i, *carry, load_pages(i))

        acc, _, l_i = jax.lax.fori_loop(0, n_iter, body, (acc0, m0, l0))
    if kind == "static":
        acc = acc * plgpu.load(vs_ref.at[h, cols(d)]).astype(jnp.float32)
    out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
    plgpu.store(o_ref.at[b, t_idx[:, None], h, g_idx[:, None], cols(d)],
                out.astype(o_ref.dtype), mask=row_mask)


@functools.partial(jax.jit, static_argnames=("cfg", "sm_scale", "interpret", "tuning"))
def prefill_attention(q, layer: LayerKV, page_tables, seq_lens, q_positions, cfg: CacheConfig,
                      sm_scale: float, interpret: bool = False,
                      tuning: PrefillTuning | None = None):
    """q [B, T, H, D] -> [B, T, H, D]; same contract as ``reference.paged_attention``.

    Static: cfg, sm_scale, interpret, tuning. Nothing is donated.
    """
    tuning = tuning or default_tuning(cfg)
    b, t, nh, d = q.shape
    hkv = cfg.num_kv_heads
    g = nh // hkv
    gp = next_pow2(g)
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for the Pallas kernel, got {d}")
    block_m = max(tuning.block_m, gp, 16)
    if block_m & (block_m - 1) or tuning.block_k & (tuning.block_k - 1):
        raise ValueError("block_m and block_k must be powers of two")
    bt = block_m // gp
    kind = scale_kind(cfg)
    qg = q.reshape(b, t, hkv, g, d)
    kernel = functools.partial(
        _prefill_kernel, sm_scale=float(sm_scale), page_size=cfg.page_size, num_groups=g,
        group_pad=gp, kind=kind, cdt=compute_dtype_for(cfg), block_m=block_m,
        block_k=tuning.block_k, scale_block=cfg.scale_block,
        page_prefetch=tuning.page_prefetch,
        variant=resolve_variant(tuning.variant, cfg, interpret))
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv, -(-t // bt)),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                             num_stages=tuning.num_stages),
        name="jfp8kv_paged_prefill",
    )(seq_lens.astype(jnp.int32), page_tables.astype(jnp.int32),
      q_positions.astype(jnp.int32), qg, layer.k.reshape(hkv, -1, d),
      layer.v.reshape(hkv, -1, d), flat_scales(layer.k_scale, cfg) if kind else None,
      flat_scales(layer.v_scale, cfg) if kind else None)
    return out.reshape(b, t, nh, d)
