"""Pieces the attention families share: a linear layer with float32 accumulation, the
paged cache step of one attention layer, the one-device form of the per-device hooks a
family's forward takes (``OneDevice``; ``models/sharding.py``'s ``TensorParallel`` is the
other) and the params' leaf names (``map_named``). The dense transformer, the MLA, hybrid and
V4 families and tensor parallelism import these from here, so no family module imports
another."""

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


class OneDevice:
    """The per-device hooks a family's forward takes (``par``), on one device: every
    section runs as it is. ``models.sharding.TensorParallel`` has the same three and runs
    them per device of its mesh (``jax.shard_map``):

    * ``attend``: ``store_and_attend``'s signature (a dense attention layer's cache step);
    * ``split(fn, in_axes, out_axes)``: ``fn`` with each argument split on its axis of
      ``in_axes`` (an int per argument, or None: whole on every device; pytree prefixes),
      outputs by ``out_axes`` ("sum": partial sums, added over the devices);
    * ``mlp(fn, h, lp, *rest)``: ``fn(h, lp, *rest)``, an MLP / MoE block over the layer's
      params ``lp``, computed per device on its slice of the intermediate axis and summed.
    """

    attend = staticmethod(store_and_attend)

    @staticmethod
    def split(fn, in_axes, out_axes):
        return fn

    @staticmethod
    def mlp(fn, h, lp, *rest):
        return fn(h, lp, *rest)


ONE_DEVICE = OneDevice()


def map_named(fn, tree: dict, prefix: str = "") -> dict:
    """``fn(name, leaf)`` over a params pytree (or one layer's dict): a leaf's name is its
    key in its layer's dict (or the top level), nested dicts joining keys with "/"
    ("compressor/wkv"); the top-level "layers" list is walked layer by layer."""
    out = {}
    for k, v in tree.items():
        if k == "layers" and not prefix and isinstance(v, list):
            out[k] = [map_named(fn, lp) for lp in v]
        elif isinstance(v, dict):
            out[k] = map_named(fn, v, f"{prefix}{k}/")
        else:
            out[k] = fn(prefix + k, v)
    return out
