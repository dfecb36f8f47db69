"""Pieces the attention families share: a linear layer with float32 accumulation and the
paged cache step of one attention layer. The dense transformer, the MLA and hybrid families
and tensor parallelism import these from here, so no family module imports another."""

from __future__ import annotations

from jfp8kv import kernels
from jfp8kv.kernels.prologue import QKPrologue, acc_dtype

import jax.numpy as jnp


def linear(x, w, b=None):
    """x [..., in] @ w [in, out] (+ b), accumulated in float32 (float64 for float64 x) and
    returned in x's dtype."""
    acc = acc_dtype(x.dtype)
    y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=acc)
    if b is not None:
        y = y + b.astype(acc)
    return y.astype(x.dtype)


def store_and_attend(q, k_new, v_new, pro: QKPrologue, layer, slots, page_tables, seq_lens,
                     positions, ccfg, sm_scale: float, backend: str):
    """One layer's cache step for the chunk's projections q [N, H, hd], k/v [N, Hkv, hd]
    (N = B * T): q/k norm and RoPE (``pro``) and the K/V store at ``slots``, then attention
    of the queries [B, T, H, hd] over the paged context. Returns (out [B, T, H, hd],
    updated layer, partial stats rows [R, 6]: ``kernels.prologue_store_kv``)."""
    q, layer, st = kernels.prologue_store_kv(q, k_new, v_new, pro, layer, slots, ccfg, backend)
    q = q.reshape(*positions.shape, *q.shape[1:])
    out = kernels.paged_attention(q, layer, page_tables, seq_lens, positions, ccfg, sm_scale,
                                  backend)
    return out, layer, st
